"""Granite's muP scalars (`DecoderConfig.embedding_multiplier`, `residual_multiplier`, `attention_multiplier`,
`logits_scaling`), each 1 (or None) in every other family:

  x = embed(tokens) * embedding_multiplier
  x = x + residual_multiplier * attn(norm(x));  x = x + residual_multiplier * ffn(norm(x))
  attention's softmax over q.k * attention_multiplier (None: head_dim^-0.5)
  logits = head(norm(x)) / logits_scaling
"""

from moejax.validation import is_number, require

SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def softmax_scale(cfg) -> float:
  """The attention logits' scale of a grouped-query attention config: attention_multiplier, or head_dim^-0.5."""
  return cfg.head_dim**-0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier


def check(cfg, sequential: bool) -> None:
  """The scalars of a `DecoderConfig` (`sequential`: its family's blocks are `DecoderLayer`s), refused by name:
  numbers > 0; the residual multiplier in sequential blocks only (LongCat's shortcut blocks add theirs as published);
  the softmax scale GQA's."""
  for name in SCALARS:
    value = getattr(cfg, name)
    ok = (value is None and name == "attention_multiplier") or (is_number(value) and value > 0)
    require(ok, name, value, "a number > 0" + (" or None (head_dim^-0.5)" if name == "attention_multiplier" else ""))
  require(cfg.residual_multiplier == 1 or sequential, "residual_multiplier", cfg.residual_multiplier, "1")
  require(cfg.attention_multiplier is None or not cfg.latent, "attention_multiplier", cfg.attention_multiplier, "None")
