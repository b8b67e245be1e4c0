"""Per-device receive buffers of the MoE exchange at SMILE's sizes, worst case against bounded.

For each SMILE model of configs/mlm.py (16 nodes x 8 GPUs, 128 experts, one micro-batch of
sequences per GPU, top-1) and each path, the rows and bytes of every hop's receive buffer
(`moejax.moe.path.hop_sizes`, the sizes the layer allocates; top-1, so one row per choice) with worst-case buffers
(`buffer_factor=None`) and with each bounded factor. One buffer of activations, forward only: the
expert FFN's hidden rows, the combine and the backward hold buffers of the same row count.

  python -m experiments.exchange_memory --workdir=/tmp/exchange_memory      # configs/exchange_memory.py

Prints the table; with --workdir, writes its rows to exchange_memory.json there, a workdir of its own
(`moejax.workdir_guard`: another program's is refused, and so is a rerun with another config, naming the field).
"""

import os

from configs import mlm
from moejax import cli, workdir_guard
from moejax.moe import collective as collective_lib
from moejax.moe import path as path_lib
from moejax.runtime import mesh as mesh_lib
from moejax.validation import is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "exchange_memory.py")

SEQ_LEN, TOP_K, BYTES = 128, 1, 2  # SMILE: sequences of 128 tokens, top-1 per level, bf16


def rows(nodes: int, gpus: int, factors: list[float], paths: list[str]) -> list[dict]:
  """One row per (model, path, buffer factor): per-hop buffer rows and MiB on one device."""
  out = []
  for model, (_, d, _, _, per_gpu) in mlm.SIZES.items():
    local_rows = per_gpu * SEQ_LEN * TOP_K
    for path in paths:
      hops = path_lib.hops(path)
      for factor in [None, *factors]:
        sizes = [
          h.out_rows
          for h in path_lib.hop_sizes(
            hops,
            {mesh_lib.NODE: nodes, mesh_lib.GPU: gpus},
            local_rows,
            1,
            "ragged",
            collective_lib.buffer_bound(factor, local_rows),
          )
        ]
        out.append(
          {
            "model": model,
            "d_model": d,
            "local_rows": local_rows,
            "path": path,
            "buffer_factor": factor,
            "hop_rows": sizes,
            "hop_mib": [r * d * BYTES / 2**20 for r in sizes],
          }
        )
  return out


def check(config) -> None:
  """Every field; errors name the field."""
  require(
    all(is_number(f) and f > 0 for f in config.buffer_factors),
    "buffer_factors",
    config.buffer_factors,
    "a tuple of numbers > 0",
  )
  require(
    config.paths and set(config.paths) <= set(path_lib.PATHS),
    "paths",
    config.paths,
    f"a non-empty tuple of {tuple(path_lib.PATHS)} (moe.path's values)",
  )
  for field in ("nodes", "gpus_per_node"):
    require(is_int(config[field]), field, config[field], "a positive int")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  if workdir:
    workdir_guard.claim(workdir, "experiments.exchange_memory", config)
  table = rows(config.nodes, config.gpus_per_node, list(config.buffer_factors), list(config.paths))
  print(f"receive buffer per hop and device, {config.nodes} x {config.gpus_per_node} GPUs, bf16 (MiB)")
  print(f"{'model':<6} {'d':>5} {'rows/GPU':>9} {'path':<13} {'factor':>6}  per-hop MiB")
  for r in table:
    factor = "worst" if r["buffer_factor"] is None else f"{r['buffer_factor']:g}"
    hops = " + ".join(f"{mib:,.0f}" for mib in r["hop_mib"])
    print(f"{r['model']:<6} {r['d_model']:>5} {r['local_rows']:>9,} {r['path']:<13} {factor:>6}  {hops}")
  if workdir:
    cli.write_json(workdir, "exchange_memory.json", table)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/exchange_memory.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for exchange_memory.json (optional: without it, the table only).", required=False
  )
  cli.run(main)
