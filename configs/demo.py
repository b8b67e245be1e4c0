"""The default demo: one MoE layer on a 2-node x 4-GPU mesh (simulated CPU devices without GPUs),
checked against the single-device reference.

  python -m experiments.demo --config=configs/demo.py --config.moe.top_k=1 --config.mesh.nodes=1
  python -m experiments.demo --config.moe.routing=bilevel --config.moe.transport=bilevel --config.moe.top_k=1
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.mesh = ml_collections.ConfigDict({"nodes": 2, "gpus_per_node": 4})
  config.tokens = 512  # global tokens, split evenly over the mesh's devices
  config.seed = 0
  config.steps = 5  # timed repetitions after compilation
  config.check_reference = True
  config.tolerance = 1e-5  # relative error allowed against the reference (fp32)
  config.output = ""  # optional .npz path for y, x and the aux statistics
  config.moe = ml_collections.ConfigDict({
      "num_experts": 16,
      "top_k": 2,
      "d_model": 64,
      "d_ff": 128,
      "routing": "topk",
      "transport": "padded",
      "expert_backend": "ragged_dot",
      "num_nodes": config.mesh.get_ref("nodes"),  # used by routing=bilevel / node_limited
      "node_top_k": 1,
      "capacity_factor": ml_collections.config_dict.placeholder(float),
      "activation": "gelu",
      "gated": True,
      "renormalize": False,
      "load_balance_coef": ml_collections.config_dict.placeholder(float),  # None: the paper's value
      "local_balance_coef": ml_collections.config_dict.placeholder(float),
      "z_loss_coef": 0.001,
      "jitter": 0.0,
      "dtype": "float32",
  })
  return config
