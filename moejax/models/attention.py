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


def _attend(q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, query_positions_S, key_positions_S, scale: float,
            window: int | None):
  """Softmax attention in fp32: q [B, S, H, W] at query_positions [S] over k, v [B, S_keys, H, W] at key_positions
  [S_keys] (the cache's, or the queries' own) -> [B, S, H, W] (W: v's width); the key at position t is visible to
  the query at p iff t <= p (and p - t < window)."""
  logits_BxHxSxS = jnp.einsum("bqhw,bkhw->bhqk", q_BxSxHxW, k_BxSxHxW.astype(q_BxSxHxW.dtype),
                              preferred_element_type=jnp.float32) * scale
  visible_SxS = key_positions_S[None, :] <= query_positions_S[:, None]
  if window is not None:
    visible_SxS &= query_positions_S[:, None] - key_positions_S[None, :] < window
  probs_BxHxSxS = jax.nn.softmax(jnp.where(visible_SxS, logits_BxHxSxS, -jnp.inf), axis=-1).astype(v_BxSxHxW.dtype)
  return jnp.einsum("bhqk,bkhw->bqhw", probs_BxHxSxS, v_BxSxHxW)


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
    q_BxSxHxW = self.q_proj(x_BxSxD).reshape(b, s, h, w)
    # k, v: [B, S, num_kv_heads, W] (their own head count), then [B, S_cache, ...] with a cache.
    k_BxSxHxW, v_BxSxHxW = self.k_proj(x_BxSxD).reshape(b, s, kv, w), self.v_proj(x_BxSxD).reshape(b, s, kv, w)
    if self.q_norm is not None:
      q_BxSxHxW, k_BxSxHxW = self.q_norm(q_BxSxHxW), self.k_norm(k_BxSxHxW)
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q_BxSxHxW, k_BxSxHxW = rotate(q_BxSxHxW), rotate(k_BxSxHxW)
    key_positions_S = positions_S
    if cache is not None:
      k_BxSxHxW, v_BxSxHxW = _write(cache[0], k_BxSxHxW, start), _write(cache[1], v_BxSxHxW, start)
      key_positions_S = jnp.arange(k_BxSxHxW.shape[1])
    repeat = lambda a: jnp.repeat(a, h // kv, axis=2)  # each key/value head serves h / kv query heads
    out_BxSxHxW = _attend(q_BxSxHxW, repeat(k_BxSxHxW), repeat(v_BxSxHxW), positions_S, key_positions_S, w ** -0.5,
                          self.window)
    out_BxSxD = self.o_proj(out_BxSxHxW.reshape(b, s, h * w))
    return out_BxSxD if cache is None else (out_BxSxD, (k_BxSxHxW, v_BxSxHxW))


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
    """Widths: a head's q and k qk_nope_head_dim + qk_rope_head_dim (W here), its v v_head_dim; `latent` [B, S,
    kv_lora_rank] and `rotary_key` [B, S, qk_rope_head_dim] are what the cache keeps ([B, S_cache, ...] with one)."""
    cfg = self.cfg
    (b, s, _), h, nope, r = x_BxSxD.shape, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    q = self.q_proj(x_BxSxD) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BxSxD)))
    q_BxSxHxW = q.reshape(b, s, h, nope + r)
    compressed = self.kv_a_proj_with_mqa(x_BxSxD)
    latent, rotary_key = self.kv_a_layernorm(compressed[..., :cfg.kv_lora_rank]), compressed[..., cfg.kv_lora_rank:]
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q_rope, rotary_key = rotate(q_BxSxHxW[..., nope:]), rotate(rotary_key[:, :, None])[:, :, 0]  # one head for all
    key_positions_S = positions_S
    if cache is not None:
      latent, rotary_key = _write(cache[0], latent, start), _write(cache[1], rotary_key, start)
      key_positions_S = jnp.arange(latent.shape[1])
    keys = latent.shape[1]
    # Each head's non-rotary key and its value from the latent: [B, S_keys, H, qk_nope_head_dim + v_head_dim].
    kv_BxSxHxW = self.kv_b_proj(latent.astype(x_BxSxD.dtype)).reshape(b, keys, h, nope + cfg.v_head_dim)
    k_BxSxHxW = jnp.concatenate([kv_BxSxHxW[..., :nope], jnp.broadcast_to(
        rotary_key[:, :, None].astype(kv_BxSxHxW.dtype), (b, keys, h, r))], axis=-1)
    q_BxSxHxW = jnp.concatenate([q_BxSxHxW[..., :nope], q_rope], axis=-1)
    out_BxSxHxW = _attend(q_BxSxHxW, k_BxSxHxW, kv_BxSxHxW[..., nope:], positions_S, key_positions_S, self.scale,
                          self.window)
    out_BxSxD = self.o_proj(out_BxSxHxW.reshape(b, s, h * cfg.v_head_dim))
    return out_BxSxD if cache is None else (out_BxSxD, (latent, rotary_key))


def attention(cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs) -> nnx.Module:
  return (LatentAttention if cfg.latent else GroupedQueryAttention)(cfg, layer, rngs=rngs)


def cache_shapes(cfg: DecoderConfig, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The two cache arrays of one layer: (k, v) or MLA's (latent, rotary key), `length` positions."""
  if cfg.latent:
    return (batch, length, cfg.kv_lora_rank), (batch, length, cfg.qk_rope_head_dim)
  return ((batch, length, cfg.num_kv_heads, cfg.head_dim),) * 2
