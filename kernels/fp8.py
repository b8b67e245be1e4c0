"""FP8 grouped matmul through qwix (Google's JAX quantization library; `pip install 'moejax[fp8]'`).

ragged_dot(x, w, group_sizes): both operands cast to float8_e4m3fn with absmax scales (a scale is the
largest |value| it covers / 448, e4m3's largest finite value): one per row of x [R, K] (per token) and
one per output column of each group's weight w [G, K, N]. `qwix.ragged_dot` multiplies the FP8 values
(`jax.lax.ragged_dot_general` on the quantized arrays, fp32 accumulation) and applies both scales to the
[R, N] product, so the contraction itself is one FP8 grouped matmul.

Not DeepSeek-V3's 128-element blocks along K: with the contraction tiled, qwix splits K into a batch
axis of K/128 partial products [K/128, R, N] in fp32 that it sums afterwards (Mixtral 8x7B's first
matmul at 16384 rows: 32 x 16384 x 14336 x 4 bytes = 30 GB). Only a kernel that applies the scales
inside its K loop (DeepGEMM, tokamax's Triton ragged_dot) affords per-block scales along K.

Backward: straight-through. The gradients are those of the unquantized product, computed in the
inputs' dtype by `jax.lax.ragged_dot`'s own transpose rules from the kept x and w (the residuals are
the inputs, as for a bf16 matmul); DeepSeek-V3 also runs these two products in FP8: not here.
Rows past sum(group_sizes) give zero output rows and zero dx rows, whatever they hold.
"""

import functools

import jax
import jax.numpy as jnp

from . import checks

FP8 = jnp.float8_e4m3fn


def _qwix():
  """The qwix package, imported on first use (moejax runs without it)."""
  try:
    import qwix
  except ImportError as e:
    raise ImportError(
      "expert_backend='fp8' needs the qwix package (jax >= 0.10, flax >= 0.12): "
      "pip install 'moejax[fp8]', or use expert_backend='ragged_dot'"
    ) from e
  return qwix


def quantize(x_RxK, w_GxKxN):
  """(x, w) as qwix QArrays of float8_e4m3fn values: scales [R, 1] per row of x, [G, 1, N] per group and output
  column of w, in the inputs' dtype."""
  qwix = _qwix()
  return (qwix.quantize(x_RxK, FP8, channelwise_axes=[0]), qwix.quantize(w_GxKxN, FP8, channelwise_axes=[0, 2]))


def _in_groups(rows: int, group_sizes_G):
  """[rows, 1] bool: the row belongs to a group."""
  return jnp.arange(rows)[:, None] < jnp.sum(jnp.maximum(group_sizes_G, 0))


@jax.custom_vjp
def _ragged_dot(x_RxK, w_GxKxN, group_sizes_G):
  qx, qw = quantize(x_RxK, w_GxKxN)
  y = _qwix().ragged_dot(qx, qw, group_sizes_G, preferred_element_type=jnp.float32)
  return jnp.where(_in_groups(x_RxK.shape[0], group_sizes_G), y, 0.0)


def _ragged_dot_fwd(x_RxK, w_GxKxN, group_sizes_G):
  return _ragged_dot(x_RxK, w_GxKxN, group_sizes_G), (x_RxK, w_GxKxN, group_sizes_G)


def _ragged_dot_bwd(residuals, dy_RxN):
  x_RxK, w_GxKxN, group_sizes_G = residuals
  _, vjp = jax.vjp(functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes_G), x_RxK, w_GxKxN)
  dy_RxN = jnp.where(_in_groups(x_RxK.shape[0], group_sizes_G), dy_RxN, 0.0).astype(x_RxK.dtype)
  dx_RxK, dw_GxKxN = vjp(dy_RxN)
  return dx_RxK.astype(x_RxK.dtype), dw_GxKxN.astype(w_GxKxN.dtype), None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def ragged_dot(x_RxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """Row i of group g times w[g] in FP8: x [R, K], w [G, K, N] (one floating dtype), group_sizes [G] int ->
  [R, N] fp32. Differentiable in x and w (straight-through, see the module docstring)."""
  checks.check_rank("x", x_RxK, 2, "[R, K]")
  checks.check_rank("w", w_GxKxN, 3, "[G, K, N]")
  checks.check_floating("x", x_RxK)
  checks.check_floating("w", w_GxKxN)
  checks.check_dim("w", w_GxKxN, 1, x_RxK.shape[1], "x.shape[1] (K)")
  checks.check_group_sizes(group_sizes_G, w_GxKxN.shape[0], "w.shape[0]")
  _qwix()  # a missing package is named before anything is traced
  return _ragged_dot(x_RxK, w_GxKxN, group_sizes_G)
