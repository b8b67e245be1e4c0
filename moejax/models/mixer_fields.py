"""The token mixers' fields of a `DecoderConfig`, checked without importing the mixers' modules
(`moejax.models.token_mixers` holds each one's module and cache)."""

from moejax.validation import is_int, require

# A layer's token mixer (`moejax.models.token_mixers.MIXERS`, which holds each one's module and cache).
MIXERS = ("attention", "gated_deltanet", "dsa", "kimi_delta", "dsa_shared", "deepseek_v4")
LINEAR_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def check(cfg) -> None:
  """The mixers' fields of a `DecoderConfig` (mixers, the linear attention layers' sizes, the gated attention and
  norm flags), refused by name."""
  require(
    cfg.mixers is None
    or (isinstance(cfg.mixers, tuple) and len(cfg.mixers) == cfg.num_layers and set(cfg.mixers) <= set(MIXERS)),
    "mixers",
    cfg.mixers,
    f"None or a tuple of {cfg.num_layers} of {MIXERS}",
  )
  if "dsa_shared" in (cfg.mixers or ()):  # it reuses the top-k of the last 'dsa' layer before it
    require(
      set(cfg.mixers) <= {"dsa", "dsa_shared"} and cfg.mixers[0] == "dsa",
      "mixers",
      cfg.mixers,
      "'dsa' or 'dsa_shared' in every layer, the first 'dsa' (a 'dsa_shared' layer reuses the last 'dsa' layer's top-k)",
    )
  if {"gated_deltanet", "kimi_delta"} & set(cfg.mixers or ()):
    for name in (*LINEAR_SIZES, "linear_conv_kernel"):
      require(is_int(getattr(cfg, name)), name, getattr(cfg, name), "a positive int (linear attention layers)")
    heads, keys = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    ok, why = heads % keys == 0, f"a multiple of linear_num_key_heads={keys}"
    if "kimi_delta" in cfg.mixers:  # q, k and v alike: as many heads, as wide
      ok, why = (keys, cfg.linear_key_head_dim) == (heads, cfg.linear_value_head_dim), f"{keys} (key heads)"
    require(ok, "linear_num_value_heads", heads, why)
  for name in ("gated_attention", "norm_offset", "linear_split_projections"):
    require(isinstance(getattr(cfg, name), bool), name, getattr(cfg, name), "True or False")
  require(
    not (cfg.gated_attention and cfg.latent),
    "gated_attention",
    cfg.gated_attention,
    "False with multi-head latent attention (Qwen3-Next's gate is grouped-query attention's)",
  )
