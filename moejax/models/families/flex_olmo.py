"""FlexOlmo (`flex_olmo`, AllenAI; transformers' FlexOlmoForCausalLM): OLMoE's attention (QK-norm over the whole q
and k projections, attention_bias on q, k, v and o alike) and MoE layers (every layer, softmax top-k renormalised only
with norm_topk_prob, the experts intermediate_size wide), in OLMo 2's post-norm blocks (`DecoderConfig.post_norm`):
x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x)), no norm on the sublayers' inputs.
No clip_qkv (FlexOlmoConfig has none). moejax keeps no token ids, so the export writes pad_token_id null where
FlexOlmoConfig's default (100277, transformers' embedding padding_idx) lies past the vocabulary."""

import dataclasses

from moejax.models.families.olmoe import Olmoe
from moejax.validation import require

PAD_TOKEN = 100277  # FlexOlmoConfig's default pad_token_id


@dataclasses.dataclass(frozen=True)
class FlexOlmo(Olmoe):
  def decoder_fields(self, hf: dict) -> dict:
    return {**super().decoder_fields(hf), "clip_qkv": None, "post_norm": True}

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, want in (("post_norm", True), ("clip_qkv", None)):
      require(
        getattr(cfg, name) == want, name, getattr(cfg, name), f"{want!r}: FlexOlmo's config.json cannot say otherwise"
      )
    fields = {k: v for k, v in super().to_hf(cfg, moe_cfg).items() if k != "clip_qkv"}
    return {**fields, **({} if cfg.vocab_size > PAD_TOKEN else {"pad_token_id": None})}


FLEX_OLMO = FlexOlmo(
  "flex_olmo",
  "FlexOlmoForCausalLM",
  # each block's two norms follow its sublayers: moejax's ln_attn, ln_ffn (usually input_layernorm, post_attention_)
  renames=(
    (r"\.post_attention_layernorm\.", ".post_feedforward_layernorm."),
    (r"\.input_layernorm\.", ".post_attention_layernorm."),
  ),
)
