"""Grouped matmul `gmm` and its transpose `tgmm` as Pallas kernels, differentiable through gmm.

Semantics match `jax.lax.ragged_dot`: group g owns the next group_sizes[g] rows of lhs, in
order; rows past sum(group_sizes) belong to no group, are never read, and their output rows are
zero (a sum past M truncates the last groups at row M; negative sizes count as 0).
Accumulation is fp32; fp32 inputs use IEEE fp32 products. Tiles come from `tuning` unless
`tiling` is given. Runs compiled by Triton when the inputs (or the default backend) are on a GPU,
otherwise in the Pallas interpreter; `interpret` overrides.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import backend, checks, tile_order, tuning
from .gmm_kernel import grouped_matmul
from .tgmm_kernel import transposed_grouped_matmul


class _Options(NamedTuple):
  transpose_rhs: bool
  out_dtype: jnp.dtype
  tiling: tuning.TileConfig | None
  interpret: bool


def _config(kernel, tiling, interpret, dtype, m, num_groups, *arrays):
  config = tiling or tuning.get_config(kernel, backend.device_kind(interpret, *arrays), dtype, m, num_groups)
  config.validate(interpret)
  return config


def gmm_forward(lhs, rhs, group_sizes, opts: _Options):
  """Undifferentiated gmm on validated inputs; lhs and rhs are promoted to one dtype."""
  dtype = jnp.result_type(lhs, rhs)
  m, num_groups = lhs.shape[0], rhs.shape[0]
  config = _config("gmm", opts.tiling, opts.interpret, dtype, m, num_groups, lhs)
  visits = tile_order.make_visits(group_sizes, m, config.block_m)
  [out] = grouped_matmul(
    [lhs.astype(dtype)],
    [rhs.astype(dtype)],
    [opts.transpose_rhs],
    [[(0, 0)]],
    lambda acc: (acc,),
    [opts.out_dtype],
    visits,
    config,
    opts.interpret,
    "gmm",
  )
  return out


def tgmm_forward(lhs, rhs, group_sizes, out_dtype, tiling, interpret):
  """Undifferentiated tgmm on validated inputs; lhs and rhs are promoted to one dtype."""
  dtype = jnp.result_type(lhs, rhs)
  m, num_groups = lhs.shape[0], group_sizes.shape[0]
  config = _config("tgmm", tiling, interpret, dtype, m, num_groups, lhs)
  starts, ends = tile_order.group_bounds(group_sizes, m)
  return transposed_grouped_matmul(lhs.astype(dtype), rhs.astype(dtype), starts, ends, out_dtype, config, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, opts):
  return gmm_forward(lhs, rhs, group_sizes, opts)


def _gmm_fwd(lhs, rhs, group_sizes, opts):
  return gmm_forward(lhs, rhs, group_sizes, opts), (lhs, rhs, group_sizes)


def _gmm_bwd(opts, residuals, dout):
  """dlhs = gmm(dout, rhs^T); drhs[g] = lhs_g^T @ dout_g (or its transpose for [G, N, K] rhs)."""
  lhs, rhs, group_sizes = residuals
  dout = dout.astype(jnp.result_type(lhs, rhs))
  dlhs = gmm_forward(dout, rhs, group_sizes, opts._replace(transpose_rhs=not opts.transpose_rhs, out_dtype=lhs.dtype))
  pair = (dout, lhs) if opts.transpose_rhs else (lhs, dout)
  drhs = tgmm_forward(*pair, group_sizes, rhs.dtype, opts.tiling, opts.interpret)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  transpose_rhs: bool = False,
  preferred_element_type=None,
  tiling: tuning.TileConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """Grouped matmul: out[i] = lhs[i] @ rhs[g(i)] for the group g(i) owning row i.

  Args:
    lhs: [M, K] floating.
    rhs: [G, K, N], or [G, N, K] with transpose_rhs (then out[i] = lhs[i] @ rhs[g(i)].T).
    group_sizes: [G] integer, >= 0; rows past their sum give zero output rows.
    preferred_element_type: output dtype (default: the promoted input dtype).
    tiling: tile sizes overriding `tuning`.
    interpret: run in the Pallas interpreter (default: unless on a GPU).
  Returns:
    out: [M, N]. Differentiable in lhs and rhs (group_sizes is not).
  """
  checks.check_rank("lhs", lhs, 2, "[M, K]")
  checks.check_rank("rhs", rhs, 3, "[G, N, K]" if transpose_rhs else "[G, K, N]")
  checks.check_floating("lhs", lhs)
  checks.check_floating("rhs", rhs)
  checks.check_dim("rhs", rhs, 2 if transpose_rhs else 1, lhs.shape[1], "lhs.shape[1] (K)")
  checks.check_group_sizes(group_sizes, rhs.shape[0], "rhs.shape[0]")
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  opts = _Options(transpose_rhs, out_dtype, tiling, backend.use_interpret(interpret, lhs, rhs))
  return _gmm(lhs, rhs, group_sizes, opts)


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  preferred_element_type=None,
  tiling: tuning.TileConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """Per-group lhs^T @ rhs, the weight gradient of gmm.

  Args:
    lhs: [M, K] floating, rows grouped as in gmm.
    rhs: [M, N] floating (for a weight gradient: the output cotangent).
    group_sizes: [G] integer, >= 0; rows past their sum are ignored.
  Returns:
    out: [G, K, N], out[g] = lhs[rows of g].T @ rhs[rows of g]; zeros for empty groups.
    Not differentiable.
  """
  checks.check_rank("lhs", lhs, 2, "[M, K]")
  checks.check_rank("rhs", rhs, 2, "[M, N]")
  checks.check_floating("lhs", lhs)
  checks.check_floating("rhs", rhs)
  checks.check_dim("rhs", rhs, 0, lhs.shape[0], "lhs.shape[0] (M)")
  checks.check_group_sizes(group_sizes)
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  return tgmm_forward(lhs, rhs, group_sizes, out_dtype, tiling, backend.use_interpret(interpret, lhs, rhs))
