"""The all-to-all and one-axis collective benchmark (experiments/bench_collectives.py): each variant timed over the
row counts, and latency/bandwidth fits.

  python -m experiments.bench_collectives --workdir=/tmp/collectives   # CPU, 2 x 4 simulated
  python -m experiments.bench_collectives --workdir=/tmp/collectives_h100 --config.nodes=1 --config.gpus_per_node=8 \\
      --config.d=4096 --config.rows=16,64,256,1024,4096 --config.iters=50   # one GPU node
"""

import ml_collections

VARIANTS = ("flat", "two_hop", "padded", "ragged", "node_a2a", "gpu_all_gather", "gpu_all_reduce")


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.nodes = 2  # mesh axis 'node'
  config.gpus_per_node = 4  # mesh axis 'gpu'
  config.simulate_cpu_devices = 8  # CPU devices to expose when the backend is CPU
  config.d = 64  # row width
  config.rows = (1, 4, 16, 64, 256)  # rows each device sends to each device
  config.dtype = "float32"  # element type: float32 or bfloat16
  config.variants = VARIANTS  # exchanges and one-axis collectives to time
  config.warmup = 2  # untimed calls after compilation
  config.iters = 10  # timed calls; the median is reported
  return config
