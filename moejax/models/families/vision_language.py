"""What the vision-language families (`qwen3_5_moe`, `kimi_k25`, `llama4`) share: moejax runs their text decoder on text-only
input, the logits of transformers' ForConditionalGeneration class given input_ids alone (no pixel values).

  config.json  the decoder's fields under text_config (read as a decoder's config.json: `decoder_config`), the
               vision tower's under vision_config (not read); whether the head is tied to the embeddings is the top
               level's tie_word_embeddings (the class's default where it is absent), as the ForConditionalGeneration
               class ties its own lm_head
  tensors      the decoder's under the family's prefix (`Family.renames`), the vision tower's and projector's
               ignored on load (`Family.ignored`)
  export       the decoder alone, as the checkpoint of its text-only class (`Family.exports_as`), which
               transformers' AutoModelForCausalLM loads: moejax holds no vision tower to write
"""

from moejax.validation import require


def decoder_config(hf: dict, model_type: str, tied: bool) -> dict:
  """The decoder's config.json dict of a vision-language model's `hf`: its text_config, with the model_type
  `model_type` (the vision-language family's, whose names the checkpoint uses) and tie_word_embeddings the top
  level's (`tied` where it says none)."""
  text = hf.get("text_config")
  require(
    isinstance(text, dict) and "num_hidden_layers" in text,
    "text_config",
    text,
    f"the decoder's config (a {model_type} config.json holds it under text_config)",
  )
  return {**text, "model_type": model_type, "tie_word_embeddings": bool(hf.get("tie_word_embeddings", tied))}
