"""Published MoE layer shapes (DeepSeek-V3, Qwen3-MoE, Mixtral 8x7B) as MoEConfig fields, scaled down on request.

One source for the shapes: the trainer applies a preset named by a config's top-level `preset` field
(`apply`), and the scaling sweep and the GPU suite can take their layers from `moe_fields`.

  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/ds   # DeepSeek-V3-like, CPU-sized
  python -m experiments.train --config=configs/moe_preset.py --workdir=/tmp/q3 \\
      --config.preset=qwen3_moe --config.preset_scale=1 --config.preset_expert_scale=1   # the published shape

`scale` divides the widths (d_model, the experts' d_ff, the shared experts' width) and `expert_scale` the
number of routed experts (default `scale`), never below `min_experts` (the mesh's devices: experts are
spread over them). Routing (top-k, scores, groups, scaling, the balancing bias's rate) stays as published;
a scale at which it no longer fits (e.g. fewer experts than top-k) is an error naming the scale.

Sources (the models' config.json on the Hugging Face hub):
  deepseek_v3   deepseek-ai/DeepSeek-V3: hidden_size 7168, moe_intermediate_size 2048, n_routed_experts 256,
                n_shared_experts 1, num_experts_per_tok 8, scoring_func sigmoid, norm_topk_prob, routed_scaling_factor
                2.5, n_group 8, topk_group 4; the bias update speed 0.001 of the paper (Sec. 4.2); 61 layers (the
                first 3 dense, intermediate_size 18432), 128 heads.
  qwen3_moe     Qwen/Qwen3-30B-A3B: hidden_size 2048, moe_intermediate_size 768, num_experts 128,
                num_experts_per_tok 8, softmax with norm_topk_prob, no shared expert; 48 layers, 32 heads.
  mixtral_8x7b  mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, num_local_experts 8,
                num_experts_per_tok 2, SwiGLU experts, softmax over the chosen two; 32 layers, 32 heads. The same
                expert shape as experiments/bench_kernels.py's MODELS['mixtral_8x7b'].
"""

import dataclasses

import ml_collections

from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, is_int, require


@dataclasses.dataclass(frozen=True)
class Preset:
  """A published MoE layer: `moe` holds its MoEConfig fields at full size (d_model and d_ff included);
  layers and heads describe the whole model (not applied: the trainer's model section keeps its own)."""
  moe: dict
  layers: int
  heads: int
  # The default scales for CPU runs (`apply` with preset_scale / preset_expert_scale 0).
  cpu_scale: int
  cpu_expert_scale: int


CONFIG_FIELDS = ("preset", "preset_scale", "preset_expert_scale")  # a training config's optional top-level fields

PRESETS = {
    "deepseek_v3": Preset(
        moe=dict(d_model=7168, d_ff=2048, num_experts=256, top_k=8, score="sigmoid", renormalize=True,
                 routed_scaling=2.5, num_groups=8, topk_groups=4, bias_update_rate=0.001, num_shared_experts=1,
                 shared_d_ff=2048, gated=True, activation="silu", capacity_factor=None, balance_loss="sequence",
                 load_balance_coef=0.0001),
        layers=61, heads=128, cpu_scale=32, cpu_expert_scale=16),
    "qwen3_moe": Preset(
        moe=dict(d_model=2048, d_ff=768, num_experts=128, top_k=8, score="softmax", renormalize=True,
                 gated=True, activation="silu", capacity_factor=None, load_balance_coef=0.001),
        layers=48, heads=32, cpu_scale=16, cpu_expert_scale=8),
    "mixtral_8x7b": Preset(
        moe=dict(d_model=4096, d_ff=14336, num_experts=8, top_k=2, score="softmax", renormalize=True, gated=True,
                 activation="silu", capacity_factor=None, load_balance_coef=0.02),
        layers=32, heads=32, cpu_scale=64, cpu_expert_scale=1),
}
# DeepSeek-V3's sequence-wise balance loss coefficient alpha = 0.0001 (Sec. 4.2); Qwen3-MoE's router_aux_loss_coef
# 0.001 and Mixtral's 0.02 (their config.json files).


def moe_fields(name: str, scale: int = 1, expert_scale: int | None = None, min_experts: int = 1) -> dict:
  """The MoEConfig fields of preset `name` with d_model, d_ff and the shared width divided by `scale` and the
  routed experts by `expert_scale` (default `scale`; at least `min_experts`, and a multiple of the groups of
  group-limited routing). Checked by building the MoEConfig; errors name the scale."""
  require(name in PRESETS, "preset", name, f"one of {sorted(PRESETS)}")
  expert_scale = scale if expert_scale is None else expert_scale
  for field, value in (("preset_scale", scale), ("preset_expert_scale", expert_scale)):
    require(is_int(value), field, value, "a positive int")
  fields = dict(PRESETS[name].moe)
  for width in ("d_model", "d_ff", "shared_d_ff"):
    if width in fields:
      require(fields[width] % scale == 0, "preset_scale", scale, f"a divisor of {name}'s {width}={fields[width]}")
      fields[width] //= scale
  experts = max(fields["num_experts"] // expert_scale, min_experts)
  groups = fields.get("num_groups")
  if groups is not None:
    experts = max(experts, groups)
    experts -= experts % groups
  fields["num_experts"] = experts
  try:
    MoEConfig(**fields)
  except ConfigError as e:
    raise ConfigError(f"preset {name!r} at scale {scale}, expert scale {expert_scale} ({experts} experts): {e}",
                      "preset_expert_scale", expert_scale, "a smaller scale") from e
  return fields


def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of the training config with its preset (top-level `preset`, '' or absent = none) applied: model.d_model
  and model.d_ff from the preset (scaled by preset_scale, 0 = the preset's CPU scale), and the preset's MoE fields in
  the moe section (experts scaled by preset_expert_scale, 0 = the CPU default; never fewer than the mesh's devices).
  The config unchanged without a preset."""
  name = config.get("preset") or ""
  if not name:
    return config
  require(name in PRESETS, "preset", name, f"'' or one of {sorted(PRESETS)}")
  preset = PRESETS[name]
  scale = config.get("preset_scale") or preset.cpu_scale
  expert_scale = config.get("preset_expert_scale") or preset.cpu_expert_scale
  fields = moe_fields(name, scale, expert_scale, min_experts=config.mesh.nodes * config.mesh.gpus_per_node)
  config = ml_collections.ConfigDict(config.to_dict())  # a copy: the caller's config keeps its values
  config.model.d_model, config.model.d_ff = fields.pop("d_model"), fields.pop("d_ff")
  for key, value in fields.items():
    config.moe[key] = value
  return config
