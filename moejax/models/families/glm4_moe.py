"""GLM-4.5 / 4.6 (`glm4_moe`): GQA with q, k, v biases (attention_bias; no output bias), optional QK-norm
(use_qk_norm) and partial RoPE (the first head_dim x partial_rotary_factor dimensions of each head, half-split);
first_k_dense_replace dense layers, then MoE layers routed as DeepSeek-V3 (sigmoid scores, the
e_score_correction_bias for the choice, groups by their two best, norm_topk_prob, x routed_scaling_factor) with
shared experts (`mlp.shared_experts`); MTP layers (num_nextn_predict_layers) named as DeepSeek-V3's.

`GqaDeepSeekV3` is that decoder, GQA attention with DeepSeek-V3's MoE layers, with the flags dots1
(`families/dots1.py`) sets its own way."""

import dataclasses

from moejax.models.families.base import Family
from moejax.models.families.deepseek import DeepSeekV3
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class GqaDeepSeekV3(DeepSeekV3):
  """GQA with DeepSeek-V3's MoE layers.

  qk_norm_field: config.json's QK-norm switch (GLM-4.5's use_qk_norm); None: QK-norm is `qk_norm` always (dots1,
    Qwen3's attention). out_bias: whether o_proj has a bias with attention_bias (Qwen3's attention) or never
    (GLM-4.5). mtp: config.json's num_nextn_predict_layers read and written (GLM-4.5) or no MTP (dots1).
  """

  latent: bool = False
  attention_bias: bool = True
  qk_norm_field: str | None = "use_qk_norm"
  out_bias: bool = False
  mtp: bool = True

  def decoder_fields(self, hf: dict) -> dict:
    fields = Family.decoder_fields(self, hf)
    return {
      **fields,
      "out_bias": fields["out_bias"] and self.out_bias,
      "qk_norm": bool(hf.get(self.qk_norm_field, False)) if self.qk_norm_field else self.qk_norm,
      "num_mtp_layers": hf.get("num_nextn_predict_layers", 0) if self.mtp else 0,
    }

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_v3_router(cfg, moe_cfg)
    out_bias = cfg.qkv_bias and self.out_bias
    require(cfg.out_bias == out_bias, "out_bias", cfg.out_bias, f"{out_bias} ({cfg.family}'s o_proj)")
    fields = dict(**self.routed_to_hf(cfg, moe_cfg), attention_bias=cfg.qkv_bias)
    if self.qk_norm_field:
      fields[self.qk_norm_field] = cfg.qk_norm
    else:
      require(cfg.qk_norm == self.qk_norm, "qk_norm", cfg.qk_norm, f"{self.qk_norm} ({cfg.family}'s attention)")
    if self.mtp:
      fields["num_nextn_predict_layers"] = cfg.num_mtp_layers
    else:
      require(cfg.num_mtp_layers == 0, "num_mtp_layers", cfg.num_mtp_layers, f"0 ({cfg.family} has no MTP)")
    return fields


GLM4_MOE = GqaDeepSeekV3("glm4_moe", "Glm4MoeForCausalLM")
