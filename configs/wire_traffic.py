"""Wire traffic of the published MoE layers against the rows each hop must move and DeepEP's volume
(experiments/wire_traffic.py).

  python -m experiments.wire_traffic --workdir=/tmp/wire           # the presets' meshes, 64 devices (~3 min)
  python -m experiments.wire_traffic --config.quick=True           # 2 x 4 and 4 x 2, scaled-down experts (~25 s)
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # 2 x 4 and 4 x 2 meshes, scaled-down experts, the uniform router, the flat and node_first paths, 16 tokens per
  # device.
  config.quick = False
  config.d_sim = 64  # d_model of the simulated layer (bytes are computed at the published d)
  config.tokens_per_device = 0  # tokens each device routes (0: 128, or 16 with quick)
  return config
