"""The train step's compile time against depth: configs/decoder.py's tiny families with model.num_layers set to each
of config.layers, layers scanned (model.scan_layers=True: one compiled body per segment) and unrolled, on the 2 x 4
mesh of simulated CPU devices. Each point builds a Trainer on abstract state (nothing is initialised) and times the
step's trace and lowering, then its compilation, and counts the lowered program's lines (StableHLO text). A first
point compiled before any is measured is left out (imports and the backend's start).

  python -m experiments.compile_time --workdir=benchmarks/results/2026-11-25-cpu      # configs/compile_time.py

Prints the table (CPU seconds of trace + lower + compile, the process' threads summed: on a machine shared with other
work the wall time measures the others too; each depth's ratio to the shallowest); with --workdir, writes every
timing, wall and CPU, to compile_time.json there. CPU timings are only comparable as ratios of one run.
"""

import os
import platform
import time

from moejax import cli
from moejax.validation import is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "compile_time.py")
NODES, GPUS = 2, 4


def training_config(family: str, layers: int, scan: bool, batch_size: int, seq_len: int):
  """configs/decoder.py's tiny `family` with `layers` layers (DeepSeek's dense first layers kept first)."""
  from moejax.configs import decoder
  config = decoder.get_config(family)
  dense = decoder.TINY[family].get("dense", 0)
  config.model.update(num_layers=layers, moe_layers=tuple(i >= dense for i in range(layers)), scan_layers=scan)
  config.update(batch_size=batch_size, micro_batches=1, seq_len=seq_len)
  config.mesh.update(nodes=NODES, gpus_per_node=GPUS)
  config.data.shards = NODES * GPUS
  return config


def measure(config) -> dict:
  """Seconds to trace and lower the train step and to compile it, wall and CPU (this process' threads), and the
  lowered program's lines."""
  import jax
  import jax.numpy as jnp

  from moejax.models import state as state_lib
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import config as config_lib
  from moejax.train import objective
  from moejax.train import trainer as train

  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  mesh = mesh_lib.make_mesh(NODES, GPUS)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh, tok, donate=False)
  _, _, rest = state_lib.abstract_state(trainer.model_cfg, trainer.moe_cfg, mesh, config.seed)
  batch = jax.ShapeDtypeStruct((1, config.batch_size, config.seq_len), jnp.int32, sharding=trainer.batch_sharding)
  clocks = lambda: (time.perf_counter(), time.process_time())
  start = clocks()
  lowered = trainer.step.lower(trainer.abstract_state, rest, batch)
  lowered_at = clocks()
  lowered.compile()
  done = clocks()
  return {"trace_lower_s": lowered_at[0] - start[0], "compile_s": done[0] - lowered_at[0], "total_s": done[0] - start[0],
          "trace_lower_cpu_s": lowered_at[1] - start[1], "compile_cpu_s": done[1] - lowered_at[1],
          "total_cpu_s": done[1] - start[1], "program_lines": len(lowered.as_text().splitlines())}


def check(config) -> None:
  """Every field; errors name the field."""
  from moejax.configs import decoder
  require(config.families and all(f in decoder.TINY for f in config.families), "families", config.families,
          f"a non-empty tuple of {sorted(decoder.TINY)}")
  require(config.layers and all(is_int(n, 2) for n in config.layers), "layers", config.layers,
          "a non-empty tuple of ints >= 2 (DeepSeek's first layer is dense)")
  require(config.scan and all(isinstance(s, bool) for s in config.scan), "scan", config.scan,
          "a non-empty tuple of True / False")
  require(is_int(config.batch_size) and config.batch_size % (NODES * GPUS) == 0, "batch_size", config.batch_size,
          f"a multiple of the mesh's {NODES * GPUS} devices")
  require(is_int(config.seq_len, 2), "seq_len", config.seq_len, "an int >= 2")


def table(points: list[dict]) -> str:
  """One row per family and depth: CPU seconds of trace + lower + compile, unrolled and scanned, each with its ratio
  to the family's shallowest, and the lowered program's lines."""
  lines = [f"{'family':<12} {'layers':>6}  {'unrolled s':>10} {'(ratio)':>8}  {'scanned s':>9} {'(ratio)':>8}  "
           f"{'lines unrolled':>14} {'scanned':>8}"]
  cell = {(p["family"], p["layers"], p["scan_layers"]): p for p in points}
  for family in dict.fromkeys(p["family"] for p in points):
    depths = sorted({p["layers"] for p in points if p["family"] == family})
    row = [family]
    for layers in depths:
      parts = []
      for scan in (False, True):
        p, first = cell.get((family, layers, scan)), cell.get((family, depths[0], scan))
        parts.append(f"{p['total_cpu_s']:>10.1f} {p['total_cpu_s'] / first['total_cpu_s']:>7.2f}x" if p else
                     f"{'':>10} {'':>8}")
      sizes = [str(cell[(family, layers, s)]["program_lines"]) if (family, layers, s) in cell else "" for s in
               (False, True)]
      lines.append(f"{row[0]:<12} {layers:>6}  {parts[0]}  {parts[1]:>18}  {sizes[0]:>14} {sizes[1]:>8}")
  return "\n".join(lines)


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  from moejax.runtime import mesh as mesh_lib
  mesh_lib.simulate_cpu_devices(NODES * GPUS)
  import jax

  measure(training_config(config.families[0], min(config.layers), True, config.batch_size, config.seq_len))  # warm-up
  points = []
  for family in config.families:
    for layers in config.layers:
      for scan in config.scan:
        point = {"family": family, "layers": layers, "scan_layers": scan,
                 **measure(training_config(family, layers, scan, config.batch_size, config.seq_len))}
        print(f"{family} {layers} layers, scan_layers={scan}: {point['total_cpu_s']:.1f} CPU s, "
              f"{point['total_s']:.1f} s wall (trace + lower {point['trace_lower_cpu_s']:.1f}, compile "
              f"{point['compile_cpu_s']:.1f} CPU s)", flush=True)
        points.append(point)
  print(table(points))
  if workdir:
    cli.write_json(workdir, "compile_time.json", {
        "device": f"{NODES} x {GPUS} simulated CPU devices", "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "jax": jax.__version__, "config": config.to_dict(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "points": points})

if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/compile_time.py).")
  _WORKDIR = cli.define_workdir("Directory for compile_time.json (optional: without it, the table only).",
                                required=False)
  cli.run(main)
