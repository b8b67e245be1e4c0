"""The train step's compile time against depth, scanned and unrolled layers (experiments/compile_time.py).

python -m experiments.compile_time                                        # prints the table
python -m experiments.compile_time --workdir=benchmarks/results/2026-11-25-cpu   # and writes compile_time.json
python -m experiments.compile_time --config.families=deepseek_v3 --config.layers=4,61 --config.scan=True
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.families = ("qwen3_moe", "deepseek_v3")  # configs/decoder.py's tiny families (DeepSeek: a dense first layer)
  config.layers = (4, 8, 16, 32)  # model.num_layers of each point
  config.scan = (False, True)  # model.scan_layers of each point
  config.nodes = 2  # the mesh of simulated CPU devices: nodes x gpus_per_node
  config.gpus_per_node = 4
  config.batch_size = 8  # one micro-batch of 8 sequences, one per device of the 2 x 4 mesh (a multiple of its devices)
  config.seq_len = 32
  return config
