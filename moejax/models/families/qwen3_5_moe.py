"""Qwen3.5-MoE: `qwen3_5_moe` (transformers' Qwen3_5MoeForConditionalGeneration, the published checkpoints: a vision
tower `model.visual.*`, the decoder `model.language_model.*`, config.json's decoder fields under text_config;
`vision_language`) and `qwen3_5_moe_text` (its decoder alone, Qwen3_5MoeForCausalLM: the same tensor names, the
fields at the top level). The decoder is Qwen3-Next's (`qwen3_next`: gated DeltaNet and gated attention layers by
layer_types, (1 + weight) norms, a sigmoid-gated shared expert), with:

  - the gated DeltaNet's input projections apart, in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a
    (`DecoderConfig.linear_split_projections`), not grouped per key head;
  - every layer MoE, softmax top-k always renormalised (Qwen3-VL-MoE's router): its config.json has no
    intermediate_size, mlp_only_layers, decoder_sparse_step nor norm_topk_prob (the decoder's d_ff is the experts'
    width);
  - interleaved multimodal RoPE (rope_parameters' mrope_section): frequency i of the rotated part turns by the
    temporal, height or width position by its section. On text-only input transformers gives the three the token's
    index, so every frequency turns by the same position: exactly the partial RoPE of Qwen3-Next (half-split over
    head_dim x partial_rotary_factor, 0.25 where config.json says none), which moejax runs; mrope_section is unread.

The MTP module (`mtp.*`) and the vision tower are ignored on load, as by transformers' text-only class. `to_hf` writes
the decoder as `qwen3_5_moe_text` (config.json for Qwen3_5MoeForCausalLM, which AutoModelForCausalLM loads).
"""

import dataclasses

from moejax.models.families import vision_language
from moejax.models.families.base import moe_indices
from moejax.models.families.qwen3_next import Qwen3Next
from moejax.validation import require

ABSENT = ("norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")  # Qwen3-Next's fields this config.json lacks
MROPE = ("mrope_section", "mrope_interleaved")  # rope_parameters' multimodal fields: text-only positions make them moot


@dataclasses.dataclass(frozen=True)
class Qwen35MoeText(Qwen3Next):
  split_projections: bool = True

  def decoder_config(self, hf: dict) -> dict:
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in MROPE}
    return {**hf, "rope_parameters": rope} if "rope_parameters" in hf else hf

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers  # transformers' decoder layer always holds the MoE block

  def decoder_fields(self, hf: dict) -> dict:
    fields = super().decoder_fields(hf)  # Qwen3-Next's, its DeltaNet's projections apart (split_projections)
    return {**fields, "d_ff": hf["moe_intermediate_size"]}  # no dense layer: the experts' width

  def moe_fields(self, hf: dict) -> dict:
    return {**super().moe_fields(hf), "renormalize": True}

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, got, want in (
      ("moe_layers", len(moe_indices(cfg)), cfg.num_layers),
      ("moe.renormalize", moe_cfg.renormalize, True),
    ):
      require(got == want, name, got, f"{want!r}: Qwen3.5-MoE's config.json cannot say otherwise")
    fields = super().to_hf(cfg, moe_cfg)
    return {k: v for k, v in fields.items() if k not in ABSENT}


@dataclasses.dataclass(frozen=True)
class Qwen35Moe(Qwen35MoeText):
  exports_as: str | None = "qwen3_5_moe_text"

  def decoder_config(self, hf: dict) -> dict:
    # tie_word_embeddings: Qwen3_5MoeConfig's default false where the top level says none
    return super().decoder_config(vision_language.decoder_config(hf, self.model_type, tied=False))


NAMES = dict(shared_module="shared_expert", renames=((r"^model\.", "model.language_model."),))
QWEN3_5_MOE_TEXT = Qwen35MoeText(
  "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", ignored=(r"^mtp\.", r"^model\.visual\."), **NAMES
)
QWEN3_5_MOE = Qwen35Moe(
  "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", ignored=(r"^mtp\.", r"^model\.visual\."), **NAMES
)
