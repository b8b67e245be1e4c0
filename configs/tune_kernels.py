"""Tile tuning of kernels on the GPU at hand (experiments/tune_kernels.py): every candidate TileConfig, the
product of the block and launch fields below, timed per kernel, dtype and shape class.

  python -m experiments.tune_kernels --workdir=/tmp/tuned
  python -m experiments.tune_kernels --workdir=/tmp/tuned --config.smoke=True   # CPU, interpreted
  python -m experiments.tune_kernels --workdir=/tmp/tgmm --config.kernels=tgmm --config.block_k=64,128
"""

import ml_collections

from kernels import tuning


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.smoke = False  # tiny shapes, two candidates (runs on CPU, interpreted)
  config.kernels = tuning.KERNELS  # kernels to tune: a subset of kernels.tuning.KERNELS
  config.dtypes = ("bfloat16",)  # input dtypes to tune: bfloat16, float32
  config.block_m = (64, 128)  # candidate block_m
  config.block_n = (64, 128)  # candidate block_n
  config.block_k = (32, 64)  # candidate block_k
  config.num_warps = (4, 8)  # candidate num_warps
  config.num_stages = (3, 4)  # candidate num_stages
  config.warmup = 3  # untimed runs after compilation
  config.iters = 20  # timed runs; the median is kept
  return config
