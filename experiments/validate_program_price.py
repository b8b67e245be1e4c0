"""The compiled layer's price (`moejax.cost.program_price.price_measured`) against its measured time, on a simulated
CPU mesh: the terms (per collective kind and axes a launch and a per-byte time; per compute op category a device's
rate with every device busy, an op's launch and a call's) come from microbenchmarks only
(`moejax.study.program_calibration`), so every case is held out. Prints one row per case and pass (measured ms,
priced ms: collectives + compute, error) and writes <workdir>/program_price.json.

Beside the price, each of the program's collectives is timed alone (`alone_ms`: the same kind, axes, bytes and
operands as a program of its own) and summed, so a miss can be told apart: the terms mispricing a collective as it
runs alone (priced collectives against `alone_ms`), or a collective costing otherwise inside the program than alone
(`alone_ms` + compute against the measured layer). Each collective is also read from a profile of the program
(`profiled_phases.collective_seconds`): `inside_ms`, a device's time in the program's collectives, waits for the
other devices included, and `fastest_ms`, each collective at its fastest device's time (about the last to arrive's:
the transfer alone), with both beside the price per kind and axes (`by_kind`). The compute is read from profiles too
(`compute_inside`): each op category's self time beside its price (`profiled_by_category` against
`compute_ms_by_category`), and how much of a run's wall no device of the process computes in (`profiled_no_compute_ms`
of `profiled_wall_ms`): the time the collectives, waits included, hold the run, beside their price.

With `per_op` (the default) the program is priced a second way, each compute op at its own time alone
(`moejax.study.op_timing`: the op's module timed with every device running it) instead of its category's rate:
`per_op_priced_ms`, `per_op_compute_ms`, `per_op_collectives_ms`, `per_op_error`, and `ops_timed` (ops timed alone of the program's; the rest
keep their category's price).

  python -m experiments.validate_program_price --workdir=/tmp/program_price
  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.validate_program_price \
      --workdir=/tmp/program_price_2p      # the mesh over two processes (gloo): 'node' between them

On CPU the devices are threads sharing the host's cores and the collectives copies in memory: this checks that the
program's price adds up to what the program takes here, not a GPU cluster's numbers.
"""

import os

import jax
import jax.numpy as jnp
from absl import flags

from moejax import cli, workdir_guard
from moejax.cost import program as program_lib
from moejax.cost import program_ops, program_price
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import init_params
from moejax.runtime import distributed, host_allocator
from moejax.runtime import mesh as mesh_lib
from moejax.study import arrival_calibration, interleaved_timing, op_timing, profiled_phases, program_calibration
from moejax.validation import ConfigError, require

PASSES = ("fwd", "fwd_bwd")


def parse_case(text: str) -> dict:
  """'d_model:d_ff:tokens:path:collective' -> its fields; ConfigError naming the case otherwise."""
  parts = text.split(":")
  require(
    len(parts) == 5 and all(p.isdigit() and int(p) > 0 for p in parts[:3]),
    "cases",
    text,
    "'d_model:d_ff:tokens:path:collective' with positive integers first",
  )
  return dict(d_model=int(parts[0]), d_ff=int(parts[1]), tokens=int(parts[2]), path=parts[3], collective=parts[4])


def compiled_layer(cfg: MoEConfig, tokens: int, mesh, passes: str):
  """(compiled, args) of the layer's forward or forward+backward on random tokens, the args on the program's
  devices."""
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (tokens, cfg.d_model), jnp.float32)

  def loss(p, v):
    y, aux = moe_apply(p, v, cfg, mesh)
    return jnp.sum(y) + aux["aux_loss"]

  fn = (lambda p, v: moe_apply(p, v, cfg, mesh)) if passes == "fwd" else jax.value_and_grad(loss, argnums=(0, 1))
  compiled = jax.jit(fn).lower(params, x).compile()
  # Placed as the program reads them: else each timed call would first copy them out to the mesh.
  return compiled, jax.device_put((params, x), compiled.input_shardings[0])


def collectives_alone_seconds(compiled, mesh, repeats: int) -> float:
  """The program's collectives each timed as a program of its own (`program_calibration.time_collective` at its kind,
  axes, bytes per operand and operands), times its runs, summed: what they take one after another."""
  total = 0.0
  for c in program_lib.collectives(compiled, mesh):
    if c.axes:  # an all-gather's bytes are its result: each device puts in 1 / group of them
      block = c.bytes // (len(c.groups[0]) if c.kind == "all-gather" else 1)
      total += c.count * program_calibration.time_collective(
        c.kind, c.axes, max(1, block // c.operands), mesh, repeats, c.operands
      )
  return total


def collectives_inside(compiled, args, mesh, price, runs: int) -> dict:
  """The program's collectives as a profile of `runs` runs sees them on this process's devices, beside their price
  (`price`: `program_price.price_measured`'s): {'inside_ms': a device's mean time in them per run, waits included,
  'fastest_ms': each at its fastest event times its runs, 'by_kind': {'kind axes': {'priced_ms', 'inside_ms',
  'fastest_ms'}}}."""
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  seconds = profiled_phases.collective_seconds(compiled, args, mesh, runs)
  by_kind = {}
  for priced in price.collectives:
    c, events = priced.collective, seconds[priced.collective.name]
    row = {
      "priced_ms": 1e3 * priced.seconds,
      "inside_ms": 1e3 * sum(events) / (runs * local),
      "fastest_ms": 1e3 * min(events, default=0.0) * c.count,
    }
    kind = by_kind.setdefault(f"{c.kind} {','.join(c.axes) or '-'}", dict.fromkeys(row, 0.0))
    for key, value in row.items():
      kind[key] += value
  total = lambda key: sum(kind[key] for kind in by_kind.values())
  return {"inside_ms": total("inside_ms"), "fastest_ms": total("fastest_ms"), "by_kind": by_kind}


def compute_inside(compiled, args, mesh, runs: int) -> dict:
  """The program's compute as profiles of `runs` single runs see it on this process's devices:
  {'by_category': {op category: a device's mean self time in its ops per run, ms} (`profiled_phases.self_times`,
  beside the price's `compute_ms_by_category`; the collectives' under 'collective', the executor's own and unlisted
  instructions' under 'other'), 'no_compute_ms': the median run's wall during which no device of this process runs a
  compute op (waiting at or in collectives), 'wall_ms': that run's wall from its first op to its last}. An op whose
  work runs as tasks on other threads shows only its dispatch there (a plain dot on XLA's CPU backend: a weight
  gradient's [2, 384, 192] dot at 0.2-0.7 ms against 29 ms priced), so a category can read low."""
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  ops = {o.name: o.category for o in program_ops.ops(compiled)}
  names = {**ops, **{c.name: "collective" for c in program_lib.collectives(compiled, mesh)}}
  keys = (*program_ops.CATEGORIES, "collective", "other")
  totals, spans = dict.fromkeys(keys, 0.0), []
  for _ in range(runs):
    lines = profiled_phases.profiled_lines(compiled, args)
    run = profiled_phases.self_times(lines, names, keys)
    totals = {k: v + run[k] for k, v in totals.items()}
    spans.append(profiled_phases.covered_seconds(lines, set(ops), set(names)))
  covered, wall = sorted(spans, key=lambda s: s[1])[len(spans) // 2]
  return {
    "by_category": {k: 1e3 * v / (runs * local) for k, v in totals.items()},
    "no_compute_ms": 1e3 * (wall - covered),
    "wall_ms": 1e3 * wall,
  }


def run_case(case: dict, config, mesh, terms, timer=None, say=print) -> list[dict]:
  """The case's rows, one per pass (module docstring); with `timer` (an `op_timing.OpTimer`) also priced per op."""
  cfg = MoEConfig(
    num_experts=config.num_experts, top_k=config.top_k, d_model=case["d_model"], d_ff=case["d_ff"],
    path=case["path"], collective=case["collective"], num_nodes=config.nodes,
    capacity_factor=config.capacity_factor,
  )  # fmt: skip
  rows = []
  for passes in PASSES:
    compiled, args = compiled_layer(cfg, case["tokens"], mesh, passes)
    measured = interleaved_timing.median_seconds(compiled, args, config.repeats)
    price = program_price.price_measured(compiled, mesh, terms)
    per_op = per_op_columns(compiled, mesh, terms, timer, config.repeats, measured) if timer else {}
    rows.append(
      dict(
        case,
        passes=passes,
        measured_ms=1e3 * measured,
        priced_ms=1e3 * price.serial_s,
        collectives_ms=1e3 * price.communication_s,
        alone_ms=1e3 * collectives_alone_seconds(compiled, mesh, config.repeats),
        **collectives_inside(compiled, args, mesh, price, config.repeats),
        compute_ms=1e3 * price.compute_s,
        compute_ms_by_category={
          k: 1e3 * v for k, v in program_price.compute_by_category(program_ops.ops(compiled), terms).items()
        },
        **{f"profiled_{k}": v for k, v in compute_inside(compiled, args, mesh, config.repeats).items()},
        error=price.serial_s / measured - 1,
        **per_op,
      )
    )
    r = rows[-1]
    say(
      f"{case['d_model']:>5} {case['d_ff']:>5} {case['tokens']:>6} {case['path']:<11}{case['collective']:<9}{passes:<8}"
      f"{r['measured_ms']:>10.1f}{r['priced_ms']:>10.1f}{r['collectives_ms']:>9.1f}{r['alone_ms']:>9.1f}"
      f"{r['inside_ms']:>9.1f}{r['fastest_ms']:>9.1f}"
      f"{r['compute_ms']:>9.1f}{r['error']:>+8.0%}"
      + (f"{r['per_op_compute_ms']:>9.1f}{r['per_op_error']:>+8.0%}  {r['ops_timed']}" if per_op else ""),
      flush=True,
    )
    inside = r["profiled_by_category"]
    say(f"{'':>8}{'compute (ms)':<32}" + "".join(f"{k:>12}" for k in inside))
    say(f"{'':>8}{'priced':<32}" + "".join(f"{r['compute_ms_by_category'].get(k, 0.0):>12.2f}" for k in inside))
    say(f"{'':>8}{'profiled (self time)':<32}" + "".join(f"{v:>12.2f}" for v in inside.values()))
    say(
      f"{'':>8}no compute op running on this process: {r['profiled_no_compute_ms']:.1f} of {r['profiled_wall_ms']:.1f}"
      f" ms of a profiled run; collectives priced {r['collectives_ms']:.1f} ms"
    )
    for kind, t in r["by_kind"].items():
      say(
        f"{'':>8}{kind:<32} priced {t['priced_ms']:8.2f}  inside {t['inside_ms']:8.2f}  fastest {t['fastest_ms']:8.2f}"
      )
  return rows


def per_op_columns(compiled, mesh, terms, timer, repeats: int, measured: float) -> dict:
  """The program priced with each op at its own time alone (`op_timing`): {'per_op_priced_ms', 'per_op_compute_ms',
  'per_op_collectives_ms' (their waits after compute follow the compute before them), 'per_op_error', 'ops_timed':
  'timed/ops'}."""
  seconds = timer.op_seconds(compiled.as_text(), repeats, terms.launch_s)
  price = program_price.price_measured(compiled, mesh, terms, op_seconds=seconds)
  return dict(
    per_op_priced_ms=1e3 * price.serial_s,
    per_op_compute_ms=1e3 * price.compute_s,
    per_op_collectives_ms=1e3 * price.communication_s,
    per_op_error=price.serial_s / measured - 1,
    ops_timed=f"{len(seconds)}/{len(program_ops.ops(compiled))}",
  )


def main(argv):
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  host_allocator.retain_freed_memory()  # each run's buffers without page faults, as on a GPU
  if distributed.initialize() == "single":  # else the job's processes hold the mesh's devices
    mesh_lib.simulate_cpu_devices(config.nodes * config.gpus_per_node)
  try:
    cases = [parse_case(c) for c in config.cases]
    if jax.process_index() == 0:  # the process that writes the record
      workdir_guard.claim(workdir, "experiments.validate_program_price", config)
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  mesh = mesh_lib.make_mesh(config.nodes, config.gpus_per_node)
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  say(f"terms on the {config.nodes} x {config.gpus_per_node} CPU mesh, {jax.process_count()} process(es):", flush=True)
  terms = arrival_calibration.measure(mesh, config.repeats, say=say)
  say(f"\n{'d':>5} {'d_ff':>5} {'tokens':>6} {'path':<11}{'coll.':<9}{'pass':<8}{'measured':>10}{'priced':>10}"
      f"{'colls':>9}{'alone':>9}{'inside':>9}{'fastest':>9}{'compute':>9}{'error':>8}"
      + (f"{'per-op':>9}{'error':>8}  timed" if config.per_op else "") + "  (ms)")  # fmt: skip
  timer = op_timing.OpTimer(mesh) if config.per_op else None
  rows = [row for case in cases for row in run_case(case, config, mesh, terms, timer, say)]
  for key, name in (("error", "by category"), ("per_op_error", "per op")):
    errors = sorted(abs(r[key]) for r in rows if key in r)
    if errors:
      say(f"|error| {name}: median {errors[len(errors) // 2]:.0%}, max {errors[-1]:.0%} over {len(rows)} held-out rows")
  if timer and timer.failed:
    say(
      f"{len(timer.failed)} op modules not timed (priced by their category), e.g. {next(iter(timer.failed.values()))}"
    )
  if jax.process_index() == 0:
    record = dict(terms=terms.as_dict(), rows=rows, config=config.to_dict(), processes=jax.process_count())
    cli.write_json(workdir, "program_price.json", record)


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "validate_program_price.py"),
    "Config file (configs/validate_program_price.py).",
  )
  cli.define_workdir("Directory of program_price.json.")
  cli.run(main)
