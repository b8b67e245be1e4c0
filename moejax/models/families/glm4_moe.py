"""GLM-4.5 / 4.6 (`glm4_moe`): GQA with q, k, v biases (attention_bias; no output bias), optional QK-norm
(use_qk_norm) and partial RoPE (the first head_dim x partial_rotary_factor dimensions of each head, half-split);
first_k_dense_replace dense layers, then MoE layers routed as DeepSeek-V3 (sigmoid scores, the
e_score_correction_bias for the choice, groups by their two best, norm_topk_prob, x routed_scaling_factor) with
shared experts (`mlp.shared_experts`); MTP layers (num_nextn_predict_layers) named as DeepSeek-V3's."""

import dataclasses

from moejax.models.families.base import Family
from moejax.models.families.deepseek import DeepSeekV3
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class Glm4Moe(DeepSeekV3):
  latent: bool = False
  attention_bias: bool = True

  def decoder_fields(self, hf: dict) -> dict:
    return {
      **Family.decoder_fields(self, hf),
      "out_bias": False,
      "qk_norm": bool(hf.get("use_qk_norm", False)),
      "num_mtp_layers": hf.get("num_nextn_predict_layers", 0),
    }

  def to_hf(self, cfg, moe_cfg) -> dict:
    require(
      moe_cfg.score == "sigmoid" or not cfg.num_moe_layers,
      "moe.score",
      moe_cfg.score,
      "'sigmoid' (GLM-4.5's config.json cannot say otherwise)",
    )
    require(not cfg.out_bias, "out_bias", cfg.out_bias, "False (GLM-4.5's o_proj has no bias)")
    return dict(
      **self.routed_to_hf(cfg, moe_cfg),
      attention_bias=cfg.qkv_bias,
      use_qk_norm=cfg.qk_norm,
      num_nextn_predict_layers=cfg.num_mtp_layers,
    )


GLM4_MOE = Glm4Moe("glm4_moe", "Glm4MoeForCausalLM")
