"""The transposed grouped-matmul Pallas kernel: per-group lhs^T @ rhs (weight gradients).

One program per (group, K-tile, N-tile), flattened to a 1-D grid with the group slowest so
that a group's rows stay in L2 while its tiles run. Each program walks its group's rows in
steps of block_m from the group's first row (no alignment needed: loads are masked).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, tuning
from .gmm_kernel import dot_precision, in_bounds, load, store, tile_mask


def transposed_grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  starts: jax.Array,
  ends: jax.Array,
  out_dtype,
  config: tuning.TileConfig,
  interpret: bool,
) -> jax.Array:
  """lhs: [M, K], rhs: [M, N] of one dtype; starts, ends: [G] int32 row ranges.

  Returns out: [G, K, N] with out[g] = lhs[starts[g]:ends[g]].T @ rhs[starts[g]:ends[g]] (fp32
  accumulation), zeros for empty groups.
  """
  m, k = lhs.shape
  n = rhs.shape[1]
  num_groups = starts.shape[0]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  n_tiles, k_tiles = pl.cdiv(n, bn), pl.cdiv(k, bk)
  precision = dot_precision(lhs.dtype)
  if k == 0 or n == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)

  def kernel(start_ref, end_ref, lhs_ref, rhs_ref, out_ref):
    pid = pl.program_id(0)
    g = pid // (k_tiles * n_tiles)
    k0 = pl.multiple_of((pid // n_tiles) % k_tiles * bk, bk)
    col0 = pl.multiple_of(pid % n_tiles * bn, bn)
    k_ok, col_ok = in_bounds(k0, bk, k), in_bounds(col0, bn, n)
    start, end = start_ref[g], end_ref[g]

    def body(i, acc):
      row0 = start + i * bm
      row_ok = row0 + jnp.arange(bm, dtype=jnp.int32) < end
      a = load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], tile_mask(row_ok, k_ok, (bm, bk)))
      b = load(rhs_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], tile_mask(row_ok, col_ok, (bm, bn)))
      return acc + lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
      )

    steps = (end - start + bm - 1) // bm
    acc = lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    store(out_ref.at[g, pl.ds(k0, bk), pl.ds(col0, bn)], acc, tile_mask(k_ok, col_ok, (bk, bn)))

  return pl.pallas_call(
    kernel,
    grid=(num_groups * k_tiles * n_tiles,),
    out_shape=backend.out_shapes([((num_groups, k, n), out_dtype)], starts, ends, lhs, rhs)[0],
    compiler_params=backend.compiler_params(config),
    interpret=interpret,
    name="tgmm",
  )(starts, ends, lhs, rhs)
