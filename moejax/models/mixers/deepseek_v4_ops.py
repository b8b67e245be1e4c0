"""The small pieces DeepSeek-V4's attention (`deepseek_v4_attention`) and its compressors (`deepseek_v4_compressors`)
share: torch-layout linear maps, transformers' two RMSNorms, and the interleaved RoPE on a head's trailing dims at the
layer's rope ('main' for sliding layers, YaRN-scaled 'compress' for CSA and HCA layers)."""

import jax
import jax.numpy as jnp

from moejax.models import rope


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
  """x [..., in] @ weight [out, in]^T (torch's Linear layout)."""
  return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def rms_norm(x: jax.Array, weight, eps: float) -> jax.Array:
  """transformers' DeepseekV4RMSNorm (weight is float32 and multiplies the float32 normed x, one cast at the end)
  or, weight None, DeepseekV4UnweightedRMSNorm (the float32 1/rms cast to x's dtype, the product in x's dtype)."""
  x32 = x.astype(jnp.float32)
  inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if weight is None:
    return x * inv_rms.astype(x.dtype)
  return (weight.astype(jnp.float32) * x32 * inv_rms).astype(x.dtype)


def layer_rope(cfg) -> tuple[tuple[float, ...], float]:
  """(inverse frequencies [R / 2], factor on cos and sin) of the layer's rope: sliding layers' plain 'main' rope
  (rope_theta), compressed layers' 'compress' rope (compress_rope_theta, YaRN where compress_rope says so) for every
  rotation of the layer, as transformers' DeepseekV4Attention picks position_embeddings[rope_layer_type]."""
  if cfg.layer_type == "sliding_attention":
    return rope.frequencies(cfg.rope_head_dim, cfg.rope_theta)
  return rope.frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, dict(cfg.compress_rope) or None)


def rotate_tail(x_BxSxHxW: jax.Array, positions_BxS: jax.Array, cfg, sign: float = 1.0) -> jax.Array:
  """Interleaved RoPE (pairs 2i, 2i + 1, kept in place) on the trailing rope_head_dim dims at each token's position;
  sign -1 rotates back (transformers' -sin). cos and sin (times YaRN's attention factor, 1 unless the checkpoint
  sets it) are rounded to x's dtype, the products float32, as transformers'. (`rope.rotate` rotates the leading dims
  and regroups the pairs, which the output projection, reading the rotated-back output in place, would not undo.)"""
  inverse, factor = layer_rope(cfg)
  angles = positions_BxS.astype(jnp.float32)[..., None, None] * jnp.asarray(inverse, jnp.float32)  # [B, S, 1, R/2]
  cos = (jnp.cos(angles) * factor).astype(x_BxSxHxW.dtype).astype(jnp.float32)
  sin = sign * (jnp.sin(angles) * factor).astype(x_BxSxHxW.dtype).astype(jnp.float32)
  nope, tail = x_BxSxHxW[..., : -cfg.rope_head_dim], x_BxSxHxW[..., -cfg.rope_head_dim :].astype(jnp.float32)
  even, odd = tail[..., 0::2], tail[..., 1::2]
  pairs = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return jnp.concatenate([nope, pairs.reshape(tail.shape).astype(x_BxSxHxW.dtype)], axis=-1)
