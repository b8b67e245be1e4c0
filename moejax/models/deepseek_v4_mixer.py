"""DeepSeek-V4's attention as a decoder token mixer ('deepseek_v4', `moejax.models.token_mixers`): the layer's
tensors held as parameters in transformers' layout and names (`Tensors`), run by the pure functions of
`moejax.models.mixers.deepseek_v4_attention` (sliding, CSA or HCA by the layer's layer_types entry). Its config
comes from the config.json fields a `DecoderConfig` keeps in `deepseek_v4` (`hf_fields`), so that the attention's and
mHC's own `from_hf` read them as transformers does.

Without a cache only: the attention's decode cache (a sliding window, the tokens seen, the compressors' state:
`deepseek_v4_attention.empty_cache`) is a dict of arrays whose shapes depend on the layer type, not the (c1, c2)
pair per layer that moejax's cache and its scans hold (`moejax.infer.cache`); a cache is refused by name.
"""

import json

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.mixers import deepseek_v4_attention as v4_attention
from moejax.validation import ConfigError

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

  def __init__(self, shapes: dict, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    children = {}
    for name, shape in shapes.items():
      head, _, rest = name.partition(".")
      if rest:
        children.setdefault(head, {})[rest] = shape
      else:
        setattr(self, head, nnx.Param(_initial(name, shape, rngs.params(), param_dtype)))
    for head, sub in children.items():
      setattr(self, head, Tensors(sub, rngs=rngs, param_dtype=param_dtype))

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

  def __call__(self, x_BxSxD: jax.Array, cache=None) -> jax.Array:
    if cache is not None:
      raise ConfigError(
        "DeepSeek-V4's attention runs without a cache here: its decode state (sliding window, compressors) is not "
        "the (c1, c2) pair per layer moejax's cache holds",
        "cache",
        "a cache",
        "None (the full forward)",
      )
    b, s, _ = x_BxSxD.shape
    positions_BxS = jnp.broadcast_to(jnp.arange(s), (b, s))
    return v4_attention.attend(self.tensors(), x_BxSxD, positions_BxS, self.config).astype(x_BxSxD.dtype)


def cache_specs(cfg, batch: int, length: int):
  """Refused: see the module docstring."""
  del batch, length
  raise ConfigError(
    f"{cfg.family}: a decode cache of DeepSeek-V4's attention is not supported (its state is not one (c1, c2) pair)",
    "mixers",
    "deepseek_v4",
    "a mixer with a (c1, c2) cache",
  )
