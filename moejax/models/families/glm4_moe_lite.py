"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's decoder (MLA with q LoRA, interleaved rotary pairs by
rope_interleave, sigmoid routing with the e_score_correction_bias, groups by their two best, norm_topk_prob, x
routed_scaling_factor, shared experts) whose MoE layers are those of mlp_layer_types ('dense' or 'sparse' per layer;
default the first dense) instead of first_k_dense_replace, and whose config.json names no scoring_func nor
topk_method (the router is V3's whatever they say). The MTP layer of the published checkpoint
(num_nextn_predict_layers, `model.layers.47.*`) is named as DeepSeek-V3's; transformers ignores it."""

import dataclasses

from moejax.models.families.deepseek import DeepSeekV3


@dataclasses.dataclass(frozen=True)
class Glm4MoeLite(DeepSeekV3):
  def moe_layers(self, hf: dict, layers: int) -> tuple:
    kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    return tuple(kind == "sparse" for kind in kinds)

  def moe_fields(self, hf: dict) -> dict:
    return super().moe_fields({**hf, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})

  def layers_to_hf(self, cfg) -> dict:
    return dict(mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)])

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_v3_router(cfg, moe_cfg)
    return super().to_hf(cfg, moe_cfg)

  def version_to_hf(self, cfg, moe_cfg) -> dict:
    return dict(rope_interleave=cfg.rope_interleaved, num_nextn_predict_layers=cfg.num_mtp_layers)


GLM4_MOE_LITE = Glm4MoeLite("glm4_moe_lite", "Glm4MoeLiteForCausalLM")
