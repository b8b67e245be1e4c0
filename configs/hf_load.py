"""The checkpoint-loading benchmark (experiments/hf_load.py): a random Qwen3-MoE-shaped decoder, narrower, written
with to_hf into <workdir>/checkpoint and loaded back with from_hf; the record is <workdir>/hf_load.json.

  python -m experiments.hf_load --workdir=/tmp/hf_load   # 4 layers, 64 experts: 1.7 GB fp32 (~1 min)
  python -m experiments.hf_load --workdir=/tmp/hf_load --config.layers=2 --config.experts=16 --config.keep=True
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.layers = 4  # decoder layers, every one an MoE layer
  config.d_model = 1024
  config.heads = 16  # query heads
  config.kv_heads = 4  # key/value heads
  config.head_dim = 64
  config.experts = 64  # routed experts
  config.top_k = 8
  config.moe_d_ff = 512  # the experts' width
  config.vocab = 8192
  config.param_dtype = "float32"  # float32 or bfloat16
  config.shard_mb = 256  # MiB per safetensors file (to_hf's shard_bytes)
  config.seed = 0
  config.keep = False  # keep the checkpoint directory afterwards
  # The part this process runs: 'all' (the benchmark); 'write' and 'load' are the fresh processes it starts itself.
  config.stage = "all"
  return config
