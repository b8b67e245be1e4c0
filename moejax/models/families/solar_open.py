"""Solar Open (`solar_open`, Upstage): Llama's attention (GQA, an explicit head_dim, attention_bias on q, k and v but
never on o_proj, no QK-norm, full RoPE) with GLM-4.5's MoE layer in every layer (DeepSeek-V3's router: sigmoid scores,
the e_score_correction_bias for the choice, groups by their two best, norm_topk_prob, x routed_scaling_factor; shared
experts `mlp.shared_experts` of width moe_intermediate_size x n_shared_experts). Its config.json has no
intermediate_size (no dense layer: the decoder's d_ff is the experts' width), no first_k_dense_replace, no MTP and no
sliding window; SolarOpenConfig's defaults fill what it leaves out (one shared expert, norm_topk_prob true, eps 1e-5,
theta 1e6). Checkpoint keys as GLM-4.5's."""

import dataclasses

from moejax.models.families.glm4_moe import GqaDeepSeekV3
from moejax.validation import require

# SolarOpenConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {"moe_intermediate_size": 1280, "n_shared_experts": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5}
DEFAULT_THETA = 1_000_000.0


@dataclasses.dataclass(frozen=True)
class SolarOpen(GqaDeepSeekV3):
  qk_norm_field: str | None = None
  mtp: bool = False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # transformers' causal mask has no window whatever config.json says

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    fields = {**super().decoder_fields(hf), "d_ff": hf["moe_intermediate_size"], "rms_eps": hf["rms_norm_eps"]}
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    # transformers' router is V3's whatever config.json says
    return super().moe_fields({**DEFAULTS, **hf, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})

  def layers_to_hf(self, cfg) -> dict:
    require(
      cfg.num_moe_layers == cfg.num_layers, "moe_layers", cfg.moe_layers, "all True (Solar Open has no dense layers)"
    )
    return {}

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, want in (("sliding_window", None), ("attention_sinks", False), ("clip_qkv", None)):
      require(getattr(cfg, name) == want, name, getattr(cfg, name), f"{want!r} (Solar Open's attention)")
    return super().to_hf(cfg, moe_cfg)


SOLAR_OPEN = SolarOpen("solar_open", "SolarOpenForCausalLM")
