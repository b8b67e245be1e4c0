"""GLM-4.5V (`glm4v_moe`, transformers' Glm4vMoeForConditionalGeneration): a vision tower (`model.visual.*`) before
GLM-4.5's decoder (`model.language_model.*`, config.json's decoder fields under text_config; `vision_language`), run
on text-only input. The decoder is GLM-4.5's (`glm4_moe`: GQA with q, k, v biases, first_k_dense_replace dense layers,
then DeepSeek-V3's MoE layers with shared experts) with:

  - no QK-norm (Glm4vMoeTextConfig has no use_qk_norm) and no MTP module (no num_nextn_predict_layers; the published
    MTP layer's tensors, `model.layers.46.*` or `.92.*` inside any prefix, are ignored as transformers ignores them);
  - sectioned multimodal RoPE (rope_parameters' mrope_section) over the first head_dim x partial_rotary_factor (0.5
    where config.json says none) dimensions: on text-only input transformers gives the temporal, height and width
    positions the token's index, so it is GLM-4.5's partial half-split RoPE; mrope_section is unread.

`to_hf` writes the decoder as `glm4_moe` (Glm4MoeForCausalLM with use_qk_norm false and no MTP layer).
"""

import dataclasses

from moejax.models.families import vision_language
from moejax.models.families.glm4_moe import GqaDeepSeekV3

MROPE = ("mrope_section",)  # rope_parameters' multimodal field: text-only positions make it moot
PARTIAL_ROTARY_FACTOR = 0.5  # Glm4vMoeTextConfig's default


@dataclasses.dataclass(frozen=True)
class Glm4vMoe(GqaDeepSeekV3):
  exports_as: str | None = "glm4_moe"

  def decoder_config(self, hf: dict) -> dict:
    hf = vision_language.decoder_config(hf, self.model_type, tied=False)  # Glm4vMoeConfig's default
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in MROPE}
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR))
    return {**hf, "rope_parameters": rope}


GLM4V_MOE = Glm4vMoe(
  "glm4v_moe",
  "Glm4vMoeForConditionalGeneration",
  qk_norm_field=None,
  mtp=False,
  renames=((r"^model\.", "model.language_model."),),
  ignored=(r"^model\.visual\.", r"model\.layers\.(46|92)\."),
)
