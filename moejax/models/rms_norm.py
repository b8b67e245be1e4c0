"""RMSNorm as today's decoders use it: statistics in float32, the learned weight applied in the input's dtype, or
with `offset` (Qwen3-Next) as 1 + weight in float32 (weights stored zero-centred)."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x [..., n] -> weight * x / sqrt(mean(x^2) + eps); `weight` [n] (the checkpoints' name). offset: (1 + weight)
  instead, times the float32 normed x before the cast back (transformers' Qwen3NextRMSNorm), weight starting at 0."""

  def __init__(self, size: int, eps: float, param_dtype=jnp.float32, offset: bool = False):
    self.eps, self.offset = eps, offset
    self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((size,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.offset:
      return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def block_norm(cfg, size: int) -> RMSNorm:
  """An RMSNorm of a decoder config's blocks (the layer norms, the final norm, QK-norm): its eps, its parameters'
  dtype and its offset (`DecoderConfig.norm_offset`)."""
  return RMSNorm(size, cfg.rms_eps, jnp.dtype(cfg.param_dtype), offset=getattr(cfg, "norm_offset", False))
