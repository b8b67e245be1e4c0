"""Kimi K2.5 (`kimi_k25`, transformers' Kimi_K25ForConditionalGeneration): a vision tower (`vision_tower.*`) and
projector (`mm_projector.*`) before DeepSeek-V3's decoder (Kimi K2's: MLA, YaRN, sigmoid routing with the
e_score_correction_bias, a dense first layer, a shared expert; `deepseek`), config.json's decoder fields under
text_config (model_type deepseek_v3, or the hub's kimi_k2), read as DeepSeek-V3's; `vision_language`.

The checkpoint names the decoder's tensors as the published one does, and as transformers' save_pretrained writes
them back: `language_model.model.*` and `language_model.lm_head.weight` (transformers renames them to
model.language_model.* and lm_head on load). Kimi_K25Config ties the head to the embeddings unless its top level says
tie_word_embeddings false. On text-only input the decoder sees the token embeddings unchanged (transformers zeroes
the ids of image and video placeholders, tokens that text carries none of). `to_hf` writes the decoder as
`deepseek_v3` (DeepseekV3ForCausalLM's checkpoint, which AutoModelForCausalLM loads).
"""

import dataclasses

from moejax.models.families import vision_language
from moejax.models.families.deepseek import DeepSeekV3


@dataclasses.dataclass(frozen=True)
class KimiK25(DeepSeekV3):
  exports_as: str | None = "deepseek_v3"

  def decoder_config(self, hf: dict) -> dict:
    return vision_language.decoder_config(hf, self.model_type, tied=True)  # Kimi_K25Config's default


KIMI_K25 = KimiK25(
  "kimi_k25",
  "Kimi_K25ForConditionalGeneration",
  renames=((r"^model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head.")),
  ignored=(r"^(model\.)?vision_tower\.", r"^(model\.)?mm_projector\."),  # as published, or as save_pretrained writes
)
