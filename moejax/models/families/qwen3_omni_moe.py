"""Qwen3-Omni (`qwen3_omni_moe`, transformers' Qwen3OmniMoeForConditionalGeneration): a thinker (audio encoder
`thinker.audio_tower.*`, vision tower `thinker.visual.*`, Qwen3-MoE's decoder `thinker.model.*` and
`thinker.lm_head`) and, where enable_audio_output, a talker and code2wav that speak the thinker's text. moejax runs
the thinker's decoder on text-only input: the logits of transformers' thinker (the top class has no forward of its
own) given input_ids alone. The decoder is Qwen3-MoE's (GQA with per-head QK-norm, MoE layers by decoder_sparse_step
and mlp_only_layers, softmax top-k renormalised where norm_topk_prob), read from config.json's
thinker_config.text_config (tie_word_embeddings from thinker_config), with:

  - multimodal RoPE (rope_parameters' mrope_section): on text-only input transformers gives the temporal, height and
    width positions the token's index, so it is Qwen3-MoE's plain RoPE; mrope_section and interleaved are unread;
  - the encoders' tensors, and the talker's and code2wav's where the checkpoint holds them, ignored on load.

Qwen3OmniMoeTextConfig's default RoPE theta is 1e6 where config.json names none. `to_hf` writes the decoder as
`qwen3_moe` (Qwen3MoeForCausalLM: the same forward on text).
"""

import dataclasses

from moejax.models.families import vision_language
from moejax.models.families.qwen3_moe import Qwen3Moe
from moejax.validation import require

MROPE = ("mrope_section", "interleaved", "mrope_interleaved")  # rope_parameters' multimodal fields
DEFAULT_THETA = 1_000_000.0


@dataclasses.dataclass(frozen=True)
class Qwen3OmniMoe(Qwen3Moe):
  exports_as: str | None = "qwen3_moe"

  def decoder_config(self, hf: dict) -> dict:
    thinker = hf.get("thinker_config")
    require(
      isinstance(thinker, dict),
      "thinker_config",
      thinker,
      "the thinker's config (a qwen3_omni_moe config.json holds the decoder under thinker_config.text_config)",
    )
    hf = vision_language.decoder_config(thinker, self.model_type, tied=False)  # Qwen3OmniMoeThinkerConfig's default
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in MROPE}
    if "rope_theta" not in rope and "rope_theta" not in hf:
      rope.update(rope_type=rope.get("rope_type", "default"), rope_theta=DEFAULT_THETA)
    return {**hf, "rope_parameters": rope}


QWEN3_OMNI_MOE = Qwen3OmniMoe(
  "qwen3_omni_moe",
  "Qwen3OmniMoeForConditionalGeneration",
  qk_norm=True,
  attention_bias=True,
  renames=((r"^model\.", "thinker.model."), (r"^lm_head\.", "thinker.lm_head.")),
  ignored=(r"^thinker\.audio_tower\.", r"^thinker\.visual\.", r"^talker\.", r"^code2wav\."),
)
