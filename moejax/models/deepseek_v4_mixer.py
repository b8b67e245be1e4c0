"""DeepSeek-V4's attention as a decoder token mixer ('deepseek_v4', `moejax.models.token_mixers`): the layer's
tensors held as parameters in transformers' layout and names (`Tensors`), run by the pure functions of
`moejax.models.mixers.deepseek_v4_attention` (sliding, CSA or HCA by the layer's layer_types entry). Its config
comes from the config.json fields a `DecoderConfig` keeps in `deepseek_v4` (`hf_fields`), so that the attention's and
mHC's own `from_hf` read them as transformers does.

Its decode cache (`deepseek_v4_attention.empty_cache`: the sliding window's keys, and in a CSA / HCA layer each
compressor's last projections and its entries so far) is the tuple of that dict's arrays in `cache_names` order,
every one [B, ...], which moejax's cache lays out per layer as it does any mixer's (`moejax.infer.cache`); the tokens
seen are the decode's position `start`. None has a sequence axis written one position at a time (the window and the
compressors' buffers shift; the entries fill by window), so the whole tuple is new each call (`cache_has_positions`).
"""

import json

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.mixers import deepseek_v4_attention as v4_attention

ONES = ("norm.weight", "scale", "hc_scale")  # tensors that start at 1 (norm weights, mHC scales)
ZEROS = ("sinks", "position_bias", "base", "hc_base")  # that start at 0, as transformers initialises them


def freeze(config: dict, names) -> tuple:
  """Sorted (field, JSON value) pairs of `config`'s fields `names` that it holds: a hashable `DecoderConfig` field."""
  return tuple(sorted((name, json.dumps(config[name], sort_keys=True)) for name in names if name in config))


def hf_fields(cfg) -> dict:
  """The config.json fields a `DecoderConfig` keeps in `deepseek_v4` (`freeze`), as a dict."""
  return {name: json.loads(value) for name, value in cfg.deepseek_v4 or ()}


def attention_config(cfg, layer: int) -> v4_attention.DeepseekV4AttentionConfig:
  """Layer `layer`'s attention config (its layer type, compress rate, indexer and ropes) from cfg's fields."""
  return v4_attention.DeepseekV4AttentionConfig.from_hf(hf_fields(cfg), layer)


def _initial(name: str, shape: tuple, key: jax.Array, dtype) -> jax.Array:
  if name.endswith(ONES):
    return jnp.ones(shape, jnp.float32)
  if name.endswith(ZEROS):
    return jnp.zeros(shape, jnp.float32)
  return (jax.random.normal(key, shape) * 0.02).astype(dtype)


class Tensors(nnx.Module):
  """Tensors by dotted name ({'q_a_proj.weight': shape, ...}) as nnx.Params of nested modules, so that a parameter's
  path is its name (`q_a_proj/weight`) and its layout transformers' ([out, in] weights: read untransposed). Weights
  N(0, 0.02) in param_dtype; norm weights and scales ones, sinks, biases and bases zeros, in float32."""

  def __init__(self, shapes: dict, *, rngs: nnx.Rngs, param_dtype=jnp.float32, prefix: str = ""):
    children = {}
    for name, shape in shapes.items():
      head, _, rest = name.partition(".")
      if rest:
        children.setdefault(head, {})[rest] = shape
      else:  # initialised by its whole dotted name (a norm's `weight` is `..norm.weight`)
        setattr(self, head, nnx.Param(_initial(prefix + name, shape, rngs.params(), param_dtype)))
    for head, sub in children.items():
      setattr(self, head, Tensors(sub, rngs=rngs, param_dtype=param_dtype, prefix=f"{prefix}{head}."))

  def tensors(self, prefix: str = "") -> dict:
    """{dotted name: array} of every tensor held."""
    out = {}
    for name, value in vars(self).items():
      if isinstance(value, Tensors):
        out.update(value.tensors(f"{prefix}{name}."))
      elif isinstance(value, nnx.Param):
        out[f"{prefix}{name}"] = value[...]
    return out


class DeepseekV4Attention(Tensors):
  """Layer `layer`'s attention (`deepseek_v4_attention.attend`): x [B, S, d] -> y [B, S, d], positions 0 .. S - 1."""

  def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
    config = attention_config(cfg, layer)
    super().__init__(config.param_shapes(), rngs=rngs, param_dtype=jnp.dtype(cfg.param_dtype))
    self.config = config

  cache_has_positions = False  # the cache is new whole each call (ExFlow's step asks: `moejax.infer.exflow`)

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    """x [B, S, d] at positions start .. start + S - 1 -> y [B, S, d]; with a cache (*arrays, start) -> (y, arrays
    after these tokens): `cache_names` order, as `cache_specs` says."""
    b, s, _ = x_BxSxD.shape
    start = 0 if cache is None else cache[-1]
    positions_BxS = jnp.broadcast_to(start + jnp.arange(s), (b, s))
    if cache is None:
      return v4_attention.attend(self.tensors(), x_BxSxD, positions_BxS, self.config).astype(x_BxSxD.dtype)
    names = cache_names(self.config)
    state = {**dict(zip(names, cache[:-1])), "length": jnp.asarray(start, jnp.int32)}
    y_BxSxD, new = v4_attention.decode(self.tensors(), x_BxSxD, state, positions_BxS, self.config)
    return y_BxSxD.astype(x_BxSxD.dtype), tuple(new[name].astype(old.dtype) for name, old in zip(names, cache))


def _empty_cache_shapes(config, batch: int, length: int, dtype) -> dict:
  """{name: ShapeDtypeStruct} of `empty_cache`'s arrays (the tokens seen left out: the decode's position says it)."""
  shapes = jax.eval_shape(lambda: v4_attention.empty_cache(config, batch, jnp.dtype(dtype), max_length=length))
  return {name: shape for name, shape in shapes.items() if name != "length"}


def cache_names(config) -> tuple[str, ...]:
  """The names of a layer's cache arrays (`empty_cache`'s but the tokens seen), in the order the cache holds them."""
  return tuple(sorted(_empty_cache_shapes(config, 1, max(config.compress_rate, 1), "float32")))


def cache_specs(cfg, layer: int, batch: int, length: int) -> tuple:
  """((shape, dtype), ...) of layer `layer`'s cache arrays in `cache_names` order, room for `length` tokens: the
  window's keys [B, sliding_window, W], and in a CSA / HCA layer per compressor series its last projections
  [B, (1 + P) m, C] (kv, gate) and entries [B, length // m, width], in the compute dtype."""
  config = attention_config(cfg, layer)
  shapes = _empty_cache_shapes(config, batch, length, cfg.dtype)
  return tuple((shapes[name].shape, cfg.dtype) for name in cache_names(config))
