"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) as a decoder layer's token mixer ('dsa',
`moejax.models.token_mixers`): DeepSeek's multi-head latent attention (`attention.LatentAttention`: its parameters,
RoPE and scale) in which each query attends only to the keys a lightning indexer chooses among its causal keys.

The indexer (`self_attn.indexer.*`): per query H_I heads q_h = wq_b(q latent) [H_I, D_I], the q latent being MLA's
q_a_layernorm(q_a_proj(x)); one key per token k = LayerNorm(wk(x)) [D_I] (eps 1e-6, weight and bias); RoPE on the
first qk_rope_head_dim dimensions of both, MLA's frequencies, half-split (DeepSeek-V3.2) or in interleaved pairs
(GLM-5) as `rope_interleaved` says; per query head weights w_h = weights_proj(x) H_I^-1/2. The score of key t for
query s is sum_h w_h relu(q_h . k_t D_I^-1/2), in float32; the query keeps the top min(topk, keys) of its causal
keys, so all of them while it has at most topk (`choose`).

Computed as transformers' eager path computes it: MLA's dense logits with every key not chosen masked out before the
softmax (`masked_attention`, a [B, S, keys] mask), which is exactly the sparse attention over the chosen keys (a
gathering kernel, DeepSeek's FlashMLA, computes the same softmax without the dense logits; not here). The softmax
runs with XLA's ops, so `attention_impl` 'cudnn' and 'tokamax' are refused: the mask is per query and data-dependent.
The choice is discrete: the language-model loss gives the indexer no gradient (transformers runs it under no_grad;
DeepSeek trains it with a loss of its own, which moejax does not have).

Its decode cache stays a pair: (MLA's latent [B, S_cache, kv_lora_rank], MLA's rotary key and the indexer's key side
by side [B, S_cache, qk_rope_head_dim + D_I]), the indexer's keys cached as transformers caches them (after the norm
and RoPE), so that generation through the cache chooses as the full forward does.

GLM-5's cross-layer sharing ('dsa_shared', `SHARED`): such a layer has no indexer and attends to the keys the last
'dsa' layer before it chose for the same queries (transformers' `prev_topk_indices`; in decode the new queries'
choice among the cache's keys, which both layers' caches hold alike). In a model with such layers the layers pass
on a `Stream`, the activations x [B, S, d] beside that choice topk [B, S, K] int32 (K = min(topk, keys): memory of
the local tokens only); every loop over the layers starts one (`begin`) and applies its own x-only steps (sharding
constraints, casts, gradient ties) to x alone (`apply_x`). The first layer must be 'dsa' (`mixer_fields.check`). A shared
layer's cache is MLA's pair (latent, rotary key), without indexer keys.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import nope as nope_lib
from moejax.models import rope
from moejax.models.attention import AUTO, IMPLEMENTATIONS, LatentAttention, _write
from moejax.models.decoder_config import DecoderConfig
from moejax.models.projections import linear
from moejax.validation import is_int, require

INDEXER_FIELDS = ("head_dim", "heads", "rope_interleaved", "topk")  # `DecoderConfig.indexer`'s pairs, sorted
INDEX_EPS = 1e-6  # the indexer's k_norm (a LayerNorm), transformers' and DeepSeek's
SHARED = "dsa_shared"  # the mixer of a layer reusing the last 'dsa' layer's choice (GLM-5's indexer_types 'shared')


class Stream(NamedTuple):
  """What the layers of a model with 'dsa_shared' layers pass on: x [B, S, d] and the last 'dsa' layer's chosen keys
  topk [B, S, K] int32 (K = min(topk, keys))."""

  x: jax.Array
  topk: jax.Array


def shares(cfg) -> bool:
  """Whether some layer of `cfg` reuses an earlier layer's choice, so that its layers pass a `Stream` on."""
  return SHARED in (getattr(cfg, "mixers", None) or ())


def begin(cfg, x_BxSxD: jax.Array, cache=None):
  """What a loop over cfg's layers passes to the first: x, or a `Stream` whose topk is a placeholder of the shape a
  'dsa' layer gives (the first layer is one, so none reads it); keys: the cache's positions (its arrays
  [..., B, T, width]), else S. A Stream (begun upstream: a pipeline's earlier stage) goes on as it is."""
  if isinstance(x_BxSxD, Stream) or not shares(cfg):
    return x_BxSxD
  b, s, _ = x_BxSxD.shape
  keys = s if cache is None else jax.tree.leaves(cache)[0].shape[-2]
  return Stream(x_BxSxD, jnp.zeros((b, s, min(indexer_fields(cfg)["topk"], keys)), jnp.int32))


def apply_x(fn, carried):
  """fn on the activations of what layers pass on (x, or a `Stream`'s x), the choice beside them kept."""
  return carried._replace(x=fn(carried.x)) if isinstance(carried, Stream) else fn(carried)


def activations(carried) -> jax.Array:
  """x [B, S, d] of what the last layer passed on."""
  return carried.x if isinstance(carried, Stream) else carried


def indexer_fields(cfg: DecoderConfig) -> dict:
  """The indexer's fields of a config with 'dsa' layers (`DecoderConfig.indexer`), checked: refused by name."""
  fields = dict(cfg.indexer or ())
  require(
    tuple(sorted(fields)) == INDEXER_FIELDS
    and all(is_int(fields[k]) for k in ("head_dim", "heads", "topk"))
    and fields["head_dim"] >= cfg.qk_rope_head_dim,
    "indexer",
    cfg.indexer,
    f"sorted (field, value) pairs of {INDEXER_FIELDS}, head_dim >= qk_rope_head_dim with 'dsa' layers",
  )
  require(cfg.latent and cfg.q_lora_rank, "q_lora_rank", cfg.q_lora_rank, "an int ('dsa' layers: MLA's q latent)")
  impl = cfg.attention_impl
  require(
    impl == AUTO or IMPLEMENTATIONS[impl].keeps_scores,
    "attention_impl",
    impl,
    "'auto' or one that materialises the scores ('xla') with 'dsa' layers (their top-k mask is per query)",
  )
  return fields


def cache_specs(cfg: DecoderConfig, batch: int, length: int, shared: bool = False):
  """((shape, dtype), (shape, dtype)): MLA's latent, and its rotary key beside the indexer's key (a shared layer's
  rotary key alone)."""
  width = cfg.qk_rope_head_dim + (0 if shared else indexer_fields(cfg)["head_dim"])
  return ((batch, length, cfg.kv_lora_rank), cfg.dtype), ((batch, length, width), cfg.dtype)


def shared_cache_specs(cfg: DecoderConfig, batch: int, length: int):
  """A 'dsa_shared' layer's `cache_specs`: MLA's (latent, rotary key)."""
  return cache_specs(cfg, batch, length, shared=True)


class LayerNorm(nnx.Module):
  """x [..., n] -> (x - mean) / sqrt(var + eps) * weight + bias, statistics in float32 (torch's LayerNorm)."""

  def __init__(self, size: int, eps: float, param_dtype):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((size,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((size,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
    return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Indexer(nnx.Module):
  """The lightning indexer: wq_b [q_lora_rank, H_I D_I], wk [d, D_I], k_norm, weights_proj [d, H_I] (the
  checkpoint's names under `self_attn.indexer`)."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    fields = indexer_fields(cfg)
    self.heads, self.width, self.topk = fields["heads"], fields["head_dim"], fields["topk"]
    self.interleaved = bool(fields["rope_interleaved"])
    self.wq_b = linear(cfg, cfg.q_lora_rank, self.heads * self.width, False, rngs)
    self.wk = linear(cfg, cfg.d_model, self.width, False, rngs)
    self.k_norm = LayerNorm(self.width, INDEX_EPS, jnp.dtype(cfg.param_dtype))
    self.weights_proj = linear(cfg, cfg.d_model, self.heads, False, rngs)

  def keys(self, x_BxSxD: jax.Array, rotate) -> jax.Array:
    """x [B, S, d] -> the indexer's keys [B, S, D_I], normed and rotated (what the cache keeps)."""
    return rotate(self.k_norm(self.wk(x_BxSxD))[:, :, None], self.interleaved)[:, :, 0]

  def scores(self, x_BxSxD: jax.Array, q_latent_BxSxQ: jax.Array, keys_BxTxI: jax.Array, rotate) -> jax.Array:
    """Each query's score of each key [B, S, T], float32: sum_h w_h relu(q_h . k D_I^-1/2)."""
    b, s, _ = x_BxSxD.shape
    q_BxSxHxI = rotate(self.wq_b(q_latent_BxSxQ).reshape(b, s, self.heads, self.width), self.interleaved)
    f32 = lambda a: a.astype(jnp.float32)
    logits_BxSxHxT = jnp.einsum("bshi,bti->bsht", f32(q_BxSxHxI), f32(keys_BxTxI)) * self.width**-0.5
    weights_BxSxH = jnp.einsum("bsd,dh->bsh", f32(x_BxSxD), f32(self.weights_proj.kernel[...])) * self.heads**-0.5
    return jnp.einsum("bsh,bsht->bst", weights_BxSxH, jax.nn.relu(logits_BxSxHxT))


def top_keys(scores_BxSxT: jax.Array, visible_SxT: jax.Array, topk: int) -> jax.Array:
  """[B, S, min(topk, T)] int32: per query the indices of its top keys by score among the visible ones, as
  transformers' `topk` over the causally masked scores (every key while T <= topk; `chosen` masks the hidden)."""
  b, s, t = scores_BxSxT.shape
  if topk >= t:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, s, t))
  return jax.lax.top_k(jnp.where(visible_SxT, scores_BxSxT, -jnp.inf), topk)[1].astype(jnp.int32)


def chosen(topk_BxSxK: jax.Array, visible_SxT: jax.Array) -> jax.Array:
  """[B, S, T] bool: the keys topk names that the query sees (transformers' index mask and causal mask)."""
  (b, s, _), t = topk_BxSxK.shape, visible_SxT.shape[-1]
  rows = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
  return jnp.zeros((b, s, t), bool).at[(*rows, topk_BxSxK)].set(True) & visible_SxT


def masked_attention(q_BxSxHxW, k_BxTxHxW, v_BxTxHxV, mask_BxSxT, scale: float) -> jax.Array:
  """Softmax attention [B, S, H, V] of each query over the keys its mask shows (at least one per query), the
  logits and softmax in float32."""
  logits_BxHxSxT = jnp.einsum("bshw,bthw->bhst", q_BxSxHxW, k_BxTxHxW, preferred_element_type=jnp.float32) * scale
  probs_BxHxSxT = jax.nn.softmax(jnp.where(mask_BxSxT[:, None], logits_BxHxSxT, -jnp.inf), axis=-1)
  return jnp.einsum("bhst,bthv->bshv", probs_BxHxSxT.astype(v_BxTxHxV.dtype), v_BxTxHxV)


class SparseAttention(LatentAttention):
  """MLA (`LatentAttention`'s parameters) whose queries each see the keys its `indexer` chooses (shared: no indexer,
  the keys a `Stream`'s topk names); x [B, S, d] -> y, or with a cache (latent, rotary and indexer keys, start) ->
  (y, (latent, rotary and indexer keys)). Given a `Stream`, y is one: its output beside the choice it used."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs, shared: bool = False):
    self.topk = indexer_fields(cfg)["topk"]  # refused by name before any parameter is made
    super().__init__(cfg, layer, rngs=rngs)
    self.indexer = None if shared else Indexer(cfg, rngs=rngs)

  def __call__(self, x, cache=None):
    cfg, stream = self.cfg, x if isinstance(x, Stream) else None
    x_BxSxD = activations(x)
    (b, s, _), h, nope, r, c = (
      x_BxSxD.shape,
      cfg.num_heads,
      cfg.qk_nope_head_dim,
      cfg.qk_rope_head_dim,
      cfg.kv_lora_rank,
    )
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    rotate = lambda a, interleaved=cfg.rope_interleaved: rope.rotate(
      a, positions_S, self.inverse, self.factor, interleaved
    )
    q_latent_BxSxQ = self.q_a_layernorm(self.q_a_proj(x_BxSxD))
    q_BxSxHxW = self.q_b_proj(q_latent_BxSxQ).reshape(b, s, h, nope + r)
    q_BxSxHxW = jnp.concatenate([q_BxSxHxW[..., :nope], rotate(q_BxSxHxW[..., nope:])], axis=-1)
    if cfg.query_scaling is not None:  # Mistral 4's, every layer's (the indexer's queries are its own)
      q_BxSxHxW = nope_lib.temper(q_BxSxHxW, positions_S, *cfg.query_scaling, offset=0)
    compressed = self.kv_a_proj_with_mqa(x_BxSxD)
    latent, keys_BxSxK = self.kv_a_layernorm(compressed[..., :c]), rotate(compressed[:, :, None, c:])[:, :, 0]
    if self.indexer is not None:  # the indexer's keys beside MLA's rotary key
      keys_BxSxK = jnp.concatenate([keys_BxSxK, self.indexer.keys(x_BxSxD, rotate).astype(latent.dtype)], -1)
    if cache is not None:
      latent, keys_BxSxK = _write(cache[0], latent, start), _write(cache[1], keys_BxSxK, start)
    t = latent.shape[1]
    visible_SxT = positions_S[:, None] >= jnp.arange(t)[None, :]
    if self.indexer is None:
      require(stream is not None, "mixers", SHARED, "a layer of a model passing a Stream on (`begin`)")
      topk_BxSxK = stream.topk
    else:
      scores_BxSxT = self.indexer.scores(x_BxSxD, q_latent_BxSxQ, keys_BxSxK[..., r:], rotate)
      topk_BxSxK = top_keys(scores_BxSxT, visible_SxT, self.topk)
    # Each head's non-rotary key and its value from the latent: [B, T, H, qk_nope_head_dim + v_head_dim].
    kv_BxTxHxW = self.kv_b_proj(latent.astype(x_BxSxD.dtype)).reshape(b, t, h, nope + cfg.v_head_dim)
    rotary_BxTxHxR = jnp.broadcast_to(keys_BxSxK[:, :, None, :r].astype(kv_BxTxHxW.dtype), (b, t, h, r))
    k_BxTxHxW = jnp.concatenate([kv_BxTxHxW[..., :nope], rotary_BxTxHxR], axis=-1)
    mask_BxSxT = chosen(topk_BxSxK, visible_SxT)
    out_BxSxHxV = masked_attention(q_BxSxHxW, k_BxTxHxW, kv_BxTxHxW[..., nope:], mask_BxSxT, self.scale)
    y_BxSxD = self.o_proj(out_BxSxHxV.reshape(b, s, h * cfg.v_head_dim))
    y = y_BxSxD if stream is None else Stream(y_BxSxD, topk_BxSxK)
    return y if cache is None else (y, (latent, keys_BxSxK))


def shared_sparse_attention(cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs) -> SparseAttention:
  """A 'dsa_shared' layer's mixer: `SparseAttention` without an indexer."""
  return SparseAttention(cfg, layer, rngs=rngs, shared=True)
