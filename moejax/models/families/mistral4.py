"""Mistral Small 4 (`mistral4`, transformers' Mistral4ForCausalLM): DeepSeek-V3's decoder (MLA with q LoRA, interleaved
rotary pairs by rope_interleave, YaRN; first_k_dense_replace dense layers, then MoE + shared experts) with:

  - every layer's queries scaled by their position, q * (1 + beta log1p(floor(p / original_max))) (rope_parameters'
    llama_4_scaling_beta over its original_max_position_embeddings: `DecoderConfig.query_scaling`);
  - softmax routing (no bias), groups by the sum of their two best, renormalised with norm_topk_prob, x
    routed_scaling_factor (`DeepSeekV2`'s reader with softmax scores and `noaux_tc` groups);
  - the experts stacked as transformers' modules hold them, `mlp.experts.gate_up_proj` [E, 2f, d] (gate rows, then up)
    and `down_proj` [E, d, f] (`fused_expert_key`).

rope_parameters' partial_rotary_factor is MLA's rotary width, qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim),
as Mistral4Config derives it (a different one is refused). transformers maps mistral4 to Mistral4ForCausalLM in
AutoModelForImageTextToText (not AutoModelForCausalLM)."""

import dataclasses

from moejax.models.families.base import fused_expert_key, moe_indices
from moejax.models.families.deepseek import LATENT_FIELDS, DeepSeekV2
from moejax.validation import require

BETA = "llama_4_scaling_beta"
QUERY_SCALING = "_query_scaling"  # (original_max, beta) carried from decoder_config to decoder_fields


def _rotary_share(hf: dict) -> float:
  return hf["qk_rope_head_dim"] / (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])


@dataclasses.dataclass(frozen=True)
class Mistral4(DeepSeekV2):
  topk_method: str = "noaux_tc"  # groups by their two best

  def decoder_config(self, hf: dict) -> dict:
    rope = dict(hf.get("rope_parameters") or {})
    share = rope.pop("partial_rotary_factor", _rotary_share(hf))
    require(abs(share - _rotary_share(hf)) < 1e-6, "partial_rotary_factor", share, f"{_rotary_share(hf)} (MLA's)")
    beta, original = rope.pop(BETA, None), rope.get("original_max_position_embeddings")
    rope.pop("max_position_embeddings", None)
    scaling = None if not beta else (float(original), float(beta))
    return {**hf, "rope_parameters": rope, QUERY_SCALING: scaling}

  def decoder_fields(self, hf: dict) -> dict:
    fields = super().decoder_fields(hf)
    return {**fields, "rope_interleaved": hf.get("rope_interleave", True), "query_scaling": hf.get(QUERY_SCALING)}

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    return fused_expert_key(path, f"{container}.experts.gate_up_proj", f"{container}.experts.down_proj")

  def to_hf(self, cfg, moe_cfg) -> dict:
    if moe_indices(cfg):
      for name, want in (("score", "softmax"), ("group_score", "top2_sum"), ("bias_update_rate", 0.0)):
        got = getattr(moe_cfg, name)
        require(got == want, f"moe.{name}", got, f"{want!r}: Mistral 4's config.json cannot say otherwise")
    scaling = dict(cfg.scaling or {"rope_type": "default"})
    original, beta = cfg.query_scaling or (scaling.get("original_max_position_embeddings", 1), 0.0)
    where = scaling.setdefault("original_max_position_embeddings", original)
    require(where == original, "query_scaling", cfg.query_scaling, f"({where}, beta): YaRN's original_max")
    rope = {"rope_theta": cfg.rope_theta, **scaling, "partial_rotary_factor": _rotary_share(vars(cfg)), BETA: beta}
    return {
      **{k: getattr(cfg, k) for k in LATENT_FIELDS},
      **self.routed_to_hf(cfg, moe_cfg),
      "rope_interleave": cfg.rope_interleaved,
      "rope_parameters": rope,
      "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,  # Mistral4's rotary width is this x the factor
    }


MISTRAL4 = Mistral4("mistral4", "Mistral4ForCausalLM")
