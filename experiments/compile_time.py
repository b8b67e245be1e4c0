"""The train step's compile time against depth: configs/decoder.py's tiny families with model.num_layers set to each
of config.layers, layers scanned (model.scan_layers=True: one compiled body per segment) and unrolled, on a mesh of
simulated CPU devices (config.nodes x config.gpus_per_node, default 2 x 4). Each point builds a Trainer on abstract state (nothing is initialised) and times the
step's trace and lowering, then its compilation, and counts the lowered program's lines (StableHLO text). Each
family's shallowest scanned step, compiled before its points, is left out (imports and the backend's start). The
mechanism is moejax/bench/gpu/compile_time.py's, which the GPU suite's compile_time step runs on one device.

  python -m experiments.compile_time --workdir=benchmarks/results/2026-11-25-cpu      # configs/compile_time.py

Prints the table (CPU seconds of trace + lower + compile, the process' threads summed: on a machine shared with other
work the wall time measures the others too; each depth's ratio to the shallowest); with --workdir, writes every
timing, wall and CPU, to compile_time.json there. CPU timings are only comparable as ratios of one run. The workdir is
this program's (`moejax.workdir_guard`): another program's is refused, and so is a rerun with another config (naming
the field; the timings there are kept), before anything is compiled.
"""

import os
import platform

from moejax import cli, workdir_guard
from moejax.bench.gpu.compile_time import check_sweep, sweep, table
from moejax.validation import is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "compile_time.py")


def check(config) -> None:
  """Every field; errors name the field."""
  check_sweep(config.families, config.layers, config.scan)
  require(is_int(config.nodes, 1), "nodes", config.nodes, "an int >= 1")
  require(is_int(config.gpus_per_node, 1), "gpus_per_node", config.gpus_per_node, "an int >= 1")
  devices = config.nodes * config.gpus_per_node
  require(
    is_int(config.batch_size) and config.batch_size % devices == 0,
    "batch_size",
    config.batch_size,
    f"a multiple of the mesh's {devices} devices",
  )
  require(is_int(config.seq_len, 2), "seq_len", config.seq_len, "an int >= 2")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  if workdir:
    workdir_guard.claim(workdir, "experiments.compile_time", config)
  from moejax.runtime import mesh as mesh_lib

  nodes, gpus = config.nodes, config.gpus_per_node
  mesh_lib.simulate_cpu_devices(nodes * gpus)
  import jax

  points = [
    point
    for is_warmup, point in sweep(
      config.families, config.layers, config.scan, config.batch_size, config.seq_len, nodes, gpus
    )
    if not is_warmup
  ]
  print(table(points))
  if workdir:
    cli.write_json(
      workdir,
      "compile_time.json",
      {
        "device": f"{nodes} x {gpus} simulated CPU devices",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "config": config.to_dict(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "points": points,
      },
    )


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/compile_time.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for compile_time.json (optional: without it, the table only).", required=False
  )
  cli.run(main)
