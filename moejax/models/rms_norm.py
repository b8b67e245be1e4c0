"""RMSNorm as today's decoders use it: statistics in float32, the learned weight applied in the input's dtype."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x [..., n] -> weight * x / sqrt(mean(x^2) + eps); `weight` [n] (the checkpoints' name)."""

  def __init__(self, size: int, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((size,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)
