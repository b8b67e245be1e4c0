"""Fine-grained experts: the layer forward from E = 8 to 256 at equal active parameters, phase by phase.

DeepSeekMoE's segmentation: E = 8 s experts of width f / s and k = 2 s choices (k at most 8, then f
stays), so every token runs k x f = const hidden units. Each point runs the real layer on a simulated
2 x 4 CPU mesh and times it with `moejax.study.phase_timing.measure_phases`: the whole forward, its
exchanges, the expert FFN and the rest (routing, plan, sorts, gathers, the combine).

  python -m experiments.fine_grained --workdir=/tmp/fine_grained         # configs/fine_grained.py

Writes fine_grained.json (the record) to --workdir, a workdir of its own (`moejax.workdir_guard`: another
program's is refused, and so is a rerun with another config, naming the field; the record there is kept).
"""

import os
import time

from moejax import cli, workdir_guard
from moejax.runtime import mesh as mesh_lib
from moejax.validation import is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "fine_grained.py")


def shape_of(num_experts: int, active_hidden: int) -> tuple[int, int]:
  """(k, f) of DeepSeekMoE's segmentation of 8 experts of top-2: k = 2 E / 8 up to 8, k f = active."""
  k = min(2 * num_experts // 8, 8)
  return k, active_hidden // k


def check(config) -> None:
  """Every field before a device is made; errors name the field."""
  require(
    isinstance(config.experts, tuple) and config.experts and all(is_int(e, 8) and e % 8 == 0 for e in config.experts),
    "experts",
    config.experts,
    "a non-empty tuple of multiples of 8 (the 8 devices)",
  )
  for field in ("tokens_per_device", "d_model", "active_hidden", "repeats"):
    require(is_int(config[field]), field, config[field], "a positive int")


def run(config, workdir: str) -> dict:
  """Times every point of config.experts, prints a line each, writes fine_grained.json to `workdir`; the devices
  must exist (`simulate_cpu_devices(8)`)."""
  import jax

  from moejax.moe.config import MoEConfig
  from moejax.moe.params import init_params
  from moejax.study.phase_timing import measure_phases

  mesh = mesh_lib.make_mesh(2, 4)
  rows = []
  record = {
    "device": jax.devices()[0].device_kind,
    "mesh": [2, 4],
    "tokens_per_device": config.tokens_per_device,
    "d_model": config.d_model,
    "active_hidden": config.active_hidden,
    "collective": config.collective,
    "date": time.strftime("%Y-%m-%d"),
    "points": rows,
  }
  print(f"{'E':>4} {'k':>2} {'f':>4}  {'layer ms':>9} {'exchange':>9} {'experts':>9} {'other':>9}  other share")
  for num_experts in config.experts:
    k, f = shape_of(num_experts, config.active_hidden)
    cfg = MoEConfig(
      num_experts=num_experts,
      top_k=k,
      d_model=config.d_model,
      d_ff=f,
      collective=config.collective,
      gated=True,
      activation="silu",
    )
    params = init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (8 * config.tokens_per_device, config.d_model))
    phases = measure_phases(params, x, cfg, mesh, warmup=1, repeats=config.repeats)
    exchange = phases["layer_inter_node_ms"] + phases["layer_intra_node_ms"]
    point = {"num_experts": num_experts, "top_k": k, "d_ff": f, **phases, "exchange_ms": exchange}
    rows.append(point)
    share = phases["layer_other_ms"] / phases["layer_ms"]
    print(
      f"{num_experts:>4} {k:>2} {f:>4}  {phases['layer_ms']:9.2f} {exchange:9.2f} {phases['layer_expert_ms']:9.2f} "
      f"{phases['layer_other_ms']:9.2f}  {share:6.1%}",
      flush=True,
    )
  cli.write_json(workdir, "fine_grained.json", record)
  print("CPU times are ratios within one run (2-core machine, simulated devices)")
  return record


def main(argv):
  del argv
  config = _CONFIG.value
  check(config)
  workdir_guard.claim(_WORKDIR.value, "experiments.fine_grained", config)  # before a device is made
  mesh_lib.simulate_cpu_devices(8)
  run(config, _WORKDIR.value)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/fine_grained.py).")
  _WORKDIR = cli.define_workdir("Directory for fine_grained.json.")
  cli.run(main)
