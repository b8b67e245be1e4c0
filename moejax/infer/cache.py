"""The KV cache of autoregressive decoding: a tuple of arrays per layer of the model (a pair, but for DeepSeek-V4's
attention: its window's keys and compressors' state, `moejax.models.deepseek_v4_mixer`), as its token mixer says
(`moejax.models.token_mixers`): (k, v) [B, S, H, W], or for multi-head latent attention (DeepSeek) the compressed
(latent [B, S, C], rotary key [B, S, R]) (S: the cache length, prompt + generated tokens;
`moejax.models.attention.cache_shapes`), or for a gated DeltaNet layer (Qwen3-Next) its convolution's inputs
[B, kernel - 1, C] and its state [B, H, K, V] float32, without a sequence axis. Laid out as the model's layers are
(`moejax.models.layers`): a list of tuples, one per layer; scanned, per segment a list of tuples per sub-layer, each
array stacked [repeats, B, S, ...], which the segment's scan reads and writes layer by layer.

Every sequence of a batch is at the same position (prompts of equal length), so one position
`start` says where the next tokens go. Requests are data parallel: the cache is sharded over both
mesh axes on B ('vanilla'), or every device holds all of it ('exflow': context coherence).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models import layers as layers_lib
from moejax.models import shortcut_block, token_mixers
from moejax.models.config import ModelConfig
from moejax.models.decoder_config import DecoderConfig
from moejax.runtime.mesh import AXES
from moejax.validation import require


def cache_sharding(mesh: jax.sharding.Mesh, coherent: bool, layer_axes: int = 0) -> NamedSharding:
  """Requests [B, ...] (after `layer_axes` leading axes of stacked layers) sharded over the mesh (data parallel), or
  replicated on every device (coherent)."""
  return NamedSharding(mesh, P() if coherent else P(*(None,) * layer_axes, AXES))


def init_cache(
  cfg: ModelConfig | DecoderConfig, batch: int, length: int, mesh: jax.sharding.Mesh, coherent: bool = False
):
  """Zeros, S = length: a tuple per layer (k, v [B, S, H, W], or MLA's latent and rotary key, in the compute dtype;
  a gated DeltaNet layer's pair; DeepSeek-V4's arrays), laid out as the model's layers (module docstring)."""
  require(cfg.causal, "kind", getattr(cfg, "kind", None), "'gpt' (a KV cache serves a causal decoder)")
  require(
    isinstance(length, int) and 1 <= length <= cfg.max_len,
    "length",
    length,
    f"an int in [1, max_len={cfg.max_len}] (prompt + generated tokens)",
  )

  def zeros(spec, repeats):
    (shape, dtype), stacked = spec, () if repeats is None else (repeats,)
    sharding = cache_sharding(mesh, coherent, len(stacked))
    return jax.jit(lambda: jnp.zeros(stacked + shape, jnp.dtype(dtype)), out_shardings=sharding)()

  return layout(
    cfg, lambda repeats, layer: tuple(zeros(spec, repeats) for spec in layer_specs(cfg, layer, batch, length))
  )


def layer_specs(cfg: ModelConfig | DecoderConfig, layer: int, batch: int, length: int) -> tuple:
  """((shape, dtype), ...) of layer `layer`'s cache arrays: its token mixer's (a decoder's), or a SMILE model's
  (k, v)."""
  if isinstance(cfg, DecoderConfig) and shortcut_block.uses(cfg):  # both attentions' on an axis of 2 (LongCat)
    return shortcut_block.cache_specs(cfg, batch, length)
  if isinstance(cfg, DecoderConfig):
    return token_mixers.of(cfg, layer).cache(cfg, layer, batch, length)
  return (((batch, length, cfg.num_heads, cfg.d_model // cfg.num_heads), cfg.dtype),) * 2


def layout(cfg: ModelConfig | DecoderConfig, pair):
  """`pair(repeats, layer)` laid out as the model's layers' cache: one per layer (repeats None), or per segment one
  per sub-layer (repeats: the segment's; layer: its first repeat's, whose kind, the token mixer included, all its
  repeats share)."""
  if not cfg.scan_layers:
    return [pair(None, i) for i in range(cfg.num_layers)]
  return [[pair(seg.repeats, seg.layer(0, j)) for j in range(seg.period)] for seg in layers_lib.segments(cfg)]
