"""Per-device receive buffers of the MoE exchange at SMILE's sizes, worst case against bounded
(experiments/exchange_memory.py).

  python -m experiments.exchange_memory                                    # prints the table
  python -m experiments.exchange_memory --workdir=/tmp/exchange_memory      # and writes exchange_memory.json
  python -m experiments.exchange_memory --config.buffer_factors=1.25 --config.paths=flat,node_first
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.buffer_factors = (1.25, 2.0)  # bounded buffer factors to compare
  config.paths = ("flat", "gpu_first", "node_first")
  config.nodes = 16  # nodes of the mesh
  config.gpus_per_node = 8  # GPUs per node
  return config
