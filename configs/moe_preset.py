"""A causal decoder whose MoE layers take a published layer's shape (moejax/models/presets.py): DeepSeek-V3
(default), Qwen3-MoE (Qwen3-30B-A3B) or Mixtral 8x7B, scaled down by default so that a 2 x 4 mesh of simulated
CPU devices trains a few steps in seconds.

  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/ds
  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/mixtral --config.preset=mixtral_8x7b
  python -m experiments.train --config=configs/moe_preset.py --workdir=... --config.preset=deepseek_v3 \\
      --config.preset_scale=1 --config.preset_expert_scale=1 --config.mesh.nodes=32 --config.mesh.gpus_per_node=8

preset_scale divides d_model and the experts' d_ff, preset_expert_scale the routed experts (0: the preset's CPU
default; 1: the published shape). The preset sets model.d_model, model.d_ff and its MoE fields (routing, scores,
groups, shared experts, the balancing bias's rate); the rest of the moe section, the model's depth and heads and
the data come from this file or the command line.
"""

import ml_collections

from configs import mlm


def get_config() -> ml_collections.ConfigDict:
  config = mlm.get_config()
  config.model.kind = "gpt"
  config.seq_len = 32
  config.steps = 20
  config.preset = "deepseek_v3"  # a key of moejax.models.presets.PRESETS
  config.preset_scale = 0  # 0: the preset's CPU scale
  config.preset_expert_scale = 0
  config.moe.capacity_factor = None  # dropless, as the three published models
  config.log.every_steps = 1
  return config
