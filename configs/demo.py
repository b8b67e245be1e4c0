"""The default demo: one MoE layer on a 2-node x 4-GPU mesh (simulated CPU devices without GPUs),
checked against the single-device reference.

  python -m experiments.demo --config=configs/demo.py --config.moe.top_k=1 --config.mesh.nodes=1
  python -m experiments.demo --config.moe.routing=bilevel --config.moe.path=node_first --config.moe.top_k=1
  python -m experiments.demo --config.moe.schedule=comet --config.moe.capacity_factor=1.25

`moe` holds every MoEConfig field (configs/moe_section.py); a field that may be None also takes
`=None`, e.g. `--config.moe.capacity_factor=None` (dropless, the default here).

The mesh is `mesh` alone: no moe field resizes it. A moe field that must agree with the mesh is checked against
it and an error names both fields: moe.num_nodes (read by routing=bilevel / node_limited only) must equal
mesh.nodes, so set both to change the node count of those routings
(`--config.mesh.nodes=4 --config.moe.num_nodes=4`); moe.num_experts must be a multiple of the mesh's devices.
`--config.moe.esp_schedule=auto` is resolved for `tokens` on this mesh before the layer is built (printed).
"""

import ml_collections

from configs.moe_section import moe_section


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.mesh = ml_collections.ConfigDict({"nodes": 2, "gpus_per_node": 4})
  config.tokens = 512  # global tokens, split evenly over the mesh's devices
  config.seed = 0
  config.steps = 5  # timed repetitions after compilation
  config.check_reference = True
  config.tolerance = 1e-5  # relative error allowed against the reference (fp32)
  # Every MoEConfig field, at its default unless set here.
  config.moe = moe_section(
    num_experts=16,
    top_k=2,
    d_model=64,
    d_ff=128,
    num_nodes=config.mesh.nodes,  # a copy, not a reference: routing=bilevel / node_limited check it
    gated=True,
    z_loss_coef=0.001,
  )
  return config
