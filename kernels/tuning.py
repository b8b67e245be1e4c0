"""Tile sizes and Triton launch options, keyed by device, kernel, dtype and shape class.

Kernels: 'gmm' (one product per step), 'ffn_in' (two rhs tiles per step: the FFN's first matmul
and the gated FFN's dx), 'ffn_bwd' (the FFN backward hidden kernel: up to three accumulators),
'tgmm' (per-group lhs^T @ rhs).
The H100 bf16 entries of gmm, ffn_in and ffn_bwd were measured on one H100 80GB HBM3 (fastest of
48 candidates; benchmarks/results/2026-11-23-h100/tune_kernels.json); the others are starting points
from Triton matmul practice. `experiments/tune_kernels.py` re-tunes them on a GPU (timing with
`time_call`) and prints a replacement for `TABLE`.
"""

import dataclasses
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """block_m: rows per tile (per step of the tgmm row loop); block_n: columns; block_k: depth."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3

  def validate(self, interpret: bool):
    """Triton needs power-of-two block shapes, and tensor-core dots need every side >= 16."""
    for name in ("block_m", "block_n", "block_k"):
      b = getattr(self, name)
      if b < 1 or b & (b - 1):
        raise ValueError(f"{name}={b} must be a power of two")
      if not interpret and b < 16:
        raise ValueError(f"{name}={b} must be >= 16 on GPU")


KERNELS = ("gmm", "ffn_in", "ffn_bwd", "tgmm")
FEW_ROWS = 512  # mean rows per group below which a shape is 'few_rows'

# H100 medians at the tuning shapes (experiments/tune_kernels.py SHAPES), where measured.
_H100 = {
  ("gmm", "bf16", "many_rows"): TileConfig(128, 256, 64, num_warps=8, num_stages=3),  # 0.556 ms (was 0.650)
  ("gmm", "bf16", "few_rows"): TileConfig(128, 128, 32, num_warps=4, num_stages=3),  # 0.254 ms (was 0.323)
  ("ffn_in", "bf16", "many_rows"): TileConfig(128, 128, 32, num_warps=8, num_stages=4),  # 1.056 ms (was 1.223)
  ("ffn_in", "bf16", "few_rows"): TileConfig(128, 64, 32, num_warps=4, num_stages=3),  # 0.446 ms (was 0.516)
  ("ffn_bwd", "bf16", "many_rows"): TileConfig(128, 128, 32, num_warps=8, num_stages=4),  # 1.698 ms (was 2.827)
  ("ffn_bwd", "bf16", "few_rows"): TileConfig(64, 128, 64, num_warps=8, num_stages=3),  # 0.649 ms (was 0.859)
  ("tgmm", "bf16", "many_rows"): TileConfig(64, 128, 128, num_warps=8, num_stages=3),
  ("tgmm", "bf16", "few_rows"): TileConfig(32, 128, 128, num_warps=8, num_stages=3),
  ("gmm", "f32", "many_rows"): TileConfig(64, 64, 32, num_warps=4, num_stages=3),
  ("gmm", "f32", "few_rows"): TileConfig(64, 64, 32, num_warps=4, num_stages=3),
  ("ffn_in", "f32", "many_rows"): TileConfig(64, 64, 32, num_warps=4, num_stages=3),
  ("ffn_in", "f32", "few_rows"): TileConfig(64, 64, 32, num_warps=4, num_stages=3),
  ("ffn_bwd", "f32", "many_rows"): TileConfig(32, 64, 32, num_warps=4, num_stages=2),
  ("ffn_bwd", "f32", "few_rows"): TileConfig(32, 64, 32, num_warps=4, num_stages=2),
  ("tgmm", "f32", "many_rows"): TileConfig(32, 64, 64, num_warps=4, num_stages=3),
  ("tgmm", "f32", "few_rows"): TileConfig(32, 64, 64, num_warps=4, num_stages=3),
}

# The interpreter runs one grid step at a time: big tiles mean few steps.
_CPU = {
  (kernel, dtype, rows): TileConfig(32, 128, 128, num_warps=4, num_stages=1)
  for kernel in KERNELS
  for dtype in ("bf16", "f32")
  for rows in ("many_rows", "few_rows")
}

TABLE = {"h100": _H100, "h200": _H100, "gpu": _H100, "cpu": _CPU}


def device_key(device_kind: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'h100'; unknown GPUs share the 'gpu' entries."""
  kind = device_kind.lower()
  for key in ("h100", "h200"):
    if key in kind:
      return key
  return "gpu"


def shape_class(m: int, num_groups: int) -> str:
  return "few_rows" if m < FEW_ROWS * num_groups else "many_rows"


def dtype_class(dtype) -> str:
  return "f32" if np.dtype(dtype).itemsize >= 4 else "bf16"


def get_config(kernel: str, device: str, dtype, m: int, num_groups: int) -> TileConfig:
  """Tiles for `kernel` on `device` (a `device_key`) for m rows in num_groups groups of `dtype`."""
  return TABLE[device][kernel, dtype_class(dtype), shape_class(m, num_groups)]


def time_call(fn, args, warmup: int, iters: int) -> list[float]:
  """Seconds per call of a jitted fn, after compilation and warm-up."""
  jax.block_until_ready(fn(*args))
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times
