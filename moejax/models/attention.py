"""Causal self-attention of the decoder families, with a KV cache: grouped-query attention (Llama, Mixtral, Qwen;
qkv biases, QK-norm, sliding window) and DeepSeek's multi-head latent attention, whose cache holds the compressed
latent and the shared rotary key instead of every head's keys and values.

Both take x [B, S, d] at positions start .. start + S - 1 and, with a cache (c1, c2, start), write the new entries
there and attend over the cache (entries not written yet lie after every query, so stay hidden); they return the
output, or (output, (c1, c2)). Parameters keep the checkpoints' names (q_proj, kv_a_proj_with_mqa, ...); a kernel
is the transpose of a torch Linear weight.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import rope
from moejax.models.decoder_config import DecoderConfig
from moejax.models.rms_norm import RMSNorm


def linear(cfg: DecoderConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=bias, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                    kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


def _write(cache: jax.Array, new: jax.Array, start) -> jax.Array:
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=1)


def _attend(q_BxSxHxK, k_BxTxHxK, v_BxTxHxV, query_S, key_T, scale: float, window: int | None):
  """Softmax attention in fp32; key t is visible to the query at position p iff t <= p (and p - t < window)."""
  logits_BxHxSxT = jnp.einsum("bshk,bthk->bhst", q_BxSxHxK, k_BxTxHxK.astype(q_BxSxHxK.dtype),
                              preferred_element_type=jnp.float32) * scale
  visible_SxT = key_T[None, :] <= query_S[:, None]
  if window is not None:
    visible_SxT &= query_S[:, None] - key_T[None, :] < window
  probs = jax.nn.softmax(jnp.where(visible_SxT, logits_BxHxSxT, -jnp.inf), axis=-1).astype(v_BxTxHxV.dtype)
  return jnp.einsum("bhst,bthv->bshv", probs, v_BxTxHxV)


class GroupedQueryAttention(nnx.Module):
  """Attention with num_kv_heads key/value heads, each shared by num_heads / num_kv_heads query heads; the cache
  holds (k, v) [B, S_cache, num_kv_heads, head_dim]."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.window = cfg, cfg.window(layer)
    h, kv, w, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
    self.q_proj = linear(cfg, d, h * w, cfg.qkv_bias, rngs)
    self.k_proj = linear(cfg, d, kv * w, cfg.qkv_bias, rngs)
    self.v_proj = linear(cfg, d, kv * w, cfg.qkv_bias, rngs)
    self.o_proj = linear(cfg, h * w, d, cfg.out_bias, rngs)
    self.q_norm = RMSNorm(w, cfg.rms_eps, jnp.dtype(cfg.param_dtype)) if cfg.qk_norm else None
    self.k_norm = RMSNorm(w, cfg.rms_eps, jnp.dtype(cfg.param_dtype)) if cfg.qk_norm else None
    self.inverse, self.factor = rope.frequencies(w, cfg.rope_theta, cfg.scaling)

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    cfg = self.cfg
    (b, s, _), h, kv, w = x_BxSxD.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    q, k = self.q_proj(x_BxSxD).reshape(b, s, h, w), self.k_proj(x_BxSxD).reshape(b, s, kv, w)
    v = self.v_proj(x_BxSxD).reshape(b, s, kv, w)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q, k = rotate(q), rotate(k)
    keys_T = positions_S
    if cache is not None:
      k, v = _write(cache[0], k, start), _write(cache[1], v, start)
      keys_T = jnp.arange(k.shape[1])
    repeat = lambda a: jnp.repeat(a, h // kv, axis=2)
    out = _attend(q, repeat(k), repeat(v), positions_S, keys_T, w ** -0.5, self.window)
    out_BxSxD = self.o_proj(out.reshape(b, s, h * w))
    return out_BxSxD if cache is None else (out_BxSxD, (k, v))


class LatentAttention(nnx.Module):
  """DeepSeek's multi-head latent attention: q through an optional low-rank latent, keys and values from one
  compressed latent [kv_lora_rank] (RMS-normed) and a rotary key [qk_rope_head_dim] shared by every head; the cache
  holds (latent [B, S_cache, kv_lora_rank], rotary key [B, S_cache, qk_rope_head_dim])."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.window = cfg, cfg.window(layer)
    h, d, pd = cfg.num_heads, cfg.d_model, jnp.dtype(cfg.param_dtype)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
      self.q_proj = linear(cfg, d, h * qk, False, rngs)
    else:
      self.q_a_proj = linear(cfg, d, cfg.q_lora_rank, False, rngs)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps, pd)
      self.q_b_proj = linear(cfg, cfg.q_lora_rank, h * qk, False, rngs)
    self.kv_a_proj_with_mqa = linear(cfg, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, False, rngs)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps, pd)
    self.kv_b_proj = linear(cfg, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, rngs)
    self.o_proj = linear(cfg, h * cfg.v_head_dim, d, False, rngs)
    self.inverse, self.factor = rope.frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.scaling)
    self.scale = rope.softmax_scale(qk, cfg.scaling)

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    cfg = self.cfg
    (b, s, _), h, nope, r = x_BxSxD.shape, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    q = self.q_proj(x_BxSxD) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BxSxD)))
    q_BxSxHxQ = q.reshape(b, s, h, nope + r)
    compressed = self.kv_a_proj_with_mqa(x_BxSxD)
    latent_BxSxC, k_rope_BxSxR = self.kv_a_layernorm(compressed[..., :cfg.kv_lora_rank]), compressed[..., cfg.kv_lora_rank:]
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q_rope, k_rope_BxSxR = rotate(q_BxSxHxQ[..., nope:]), rotate(k_rope_BxSxR[:, :, None])[:, :, 0]
    keys_T = positions_S
    if cache is not None:
      latent_BxSxC, k_rope_BxSxR = _write(cache[0], latent_BxSxC, start), _write(cache[1], k_rope_BxSxR, start)
      keys_T = jnp.arange(latent_BxSxC.shape[1])
    t = latent_BxSxC.shape[1]
    kv_BxTxHxN = self.kv_b_proj(latent_BxSxC.astype(x_BxSxD.dtype)).reshape(b, t, h, nope + cfg.v_head_dim)
    k_BxTxHxQ = jnp.concatenate([kv_BxTxHxN[..., :nope], jnp.broadcast_to(
        k_rope_BxSxR[:, :, None].astype(kv_BxTxHxN.dtype), (b, t, h, r))], axis=-1)
    q_BxSxHxQ = jnp.concatenate([q_BxSxHxQ[..., :nope], q_rope], axis=-1)
    out = _attend(q_BxSxHxQ, k_BxTxHxQ, kv_BxTxHxN[..., nope:], positions_S, keys_T, self.scale, self.window)
    out_BxSxD = self.o_proj(out.reshape(b, s, h * cfg.v_head_dim))
    return out_BxSxD if cache is None else (out_BxSxD, (latent_BxSxC, k_rope_BxSxR))


def attention(cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs) -> nnx.Module:
  return (LatentAttention if cfg.latent else GroupedQueryAttention)(cfg, layer, rngs=rngs)


def cache_shapes(cfg: DecoderConfig, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The two cache arrays of one layer: (k, v) or MLA's (latent, rotary key), `length` positions."""
  if cfg.latent:
    return (batch, length, cfg.kv_lora_rank), (batch, length, cfg.qk_rope_head_dim)
  return ((batch, length, cfg.num_kv_heads, cfg.head_dim),) * 2
