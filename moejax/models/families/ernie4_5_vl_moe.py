"""ERNIE-4.5-VL (`ernie4_5_vl_moe`, transformers' Ernie4_5_VLMoeForConditionalGeneration): a vision tower
(`model.vision_model.*`) and resampler (`model.resampler_model.*`) before ERNIE-4.5-MoE's decoder (config.json's
decoder fields under text_config; `vision_language`), run on text-only input. Each MoE layer holds text experts
beside vision experts, each set with its own router; a text token is routed among the text experts only, so on text
the decoder is ERNIE-4.5-MoE's (`ernie4_5_moe`) with:

  - MoE layers by text_config's mlp_layer_types ('dense' or 'sparse'; default: the first dense, the rest sparse);
  - moe_intermediate_size a pair [text experts' width, vision experts' width]; the shared experts are the text
    width x moe_num_shared_experts wide;
  - as published (save_pretrained writes it so): the text router `mlp.gate.weight` stored TRANSPOSED, [d, E]; the
    statics' bias `mlp.moe_statics.e_score_correction_bias` [2, E], the text row first (`hf_parts.item`); the text
    experts `mlp.experts.0 .. E-1` and the vision ones `E .. 2E-1`, which are ignored on load with the vision router
    (`mlp.gate.weight_1`), the vision tower and the resampler;
  - multimodal RoPE (rope_parameters' mrope_section, the height and width frequencies pre-rotated): on text-only input
    transformers gives the temporal, height and width positions the token's index, and the rotation undoes the
    pre-rotation, so it is ERNIE-4.5's interleaved RoPE over the whole head; mrope_section is unread.

`to_hf` writes the decoder as `ernie4_5_moe` (Ernie4_5_MoeForCausalLM: the same forward on text).
"""

import dataclasses

from moejax.models import hf_parts
from moejax.models.families import vision_language
from moejax.models.families.ernie4_5_moe import Ernie45Moe
from moejax.validation import require

MROPE = ("mrope_section",)  # rope_parameters' multimodal field: text-only positions make it moot
DEFAULTS = {"moe_intermediate_size": [1536, 512]}  # Ernie4_5_VLMoeTextConfig's, where config.json is silent


@dataclasses.dataclass(frozen=True)
class Ernie45VLMoe(Ernie45Moe):
  exports_as: str | None = "ernie4_5_moe"

  def decoder_config(self, hf: dict) -> dict:
    hf = vision_language.decoder_config(hf, self.model_type, tied=True)  # Ernie4_5_VLMoeConfig's default
    widths = hf.get("moe_intermediate_size") or DEFAULTS["moe_intermediate_size"]
    require(
      isinstance(widths, list) and len(widths) == 2 and all(isinstance(w, int) and w > 0 for w in widths),
      "text_config.moe_intermediate_size",
      widths,
      "[text experts' width, vision experts' width] (ERNIE-4.5-VL's pair)",
    )
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in MROPE}
    return {**hf, "moe_intermediate_size": widths[0], "rope_parameters": rope or None}

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    require(
      len(kinds) == layers and set(kinds) <= {"dense", "sparse"},
      "mlp_layer_types",
      kinds,
      f"{layers} entries, each 'dense' or 'sparse'",
    )
    return tuple(kind == "sparse" for kind in kinds)

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path[0] == "router":  # the text router as published: [d, E], moejax's own layout
      return f"{container}.gate.weight", False
    if path == ["expert_bias"]:  # the statics' [2, E] bias: its text row
      return hf_parts.item(f"{container}.moe_statics.e_score_correction_bias", 0, 2), False
    return None

  def ignored_tensors(self, moe_cfg) -> tuple:
    vision = "|".join(str(e) for e in range(moe_cfg.num_experts, 2 * moe_cfg.num_experts))
    return (*self.ignored, rf"\.mlp\.experts\.({vision})\.")


ERNIE4_5_VL_MOE = Ernie45VLMoe(
  "ernie4_5_vl_moe",
  "Ernie4_5_VLMoeForConditionalGeneration",
  ignored=(r"^model\.vision_model\.", r"^model\.resampler_model\.", r"\.mlp\.gate\.weight_1$", r"mtp"),
)
