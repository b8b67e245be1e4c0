"""The M-tiled grouped-matmul Pallas kernel behind gmm, the fused FFN and their backward passes.

One program per (visit, N-tile), flattened to a 1-D grid and swizzled so that `_SWIZZLE`
consecutive visits share each N-tile of the rhs while it is in L2. A visit (see `tile_order`)
loads the row tile of each lhs, loops over K, and multiplies by the tiles of its group's rhs.
Several accumulators share the lhs tiles, and an accumulator may sum several products, so one
kernel computes e.g. [x @ w_gate, x @ w_in] or dz_gate @ w_gate^T + dz_in @ w_in^T. The
epilogue maps the fp32 accumulators (and the tiles of any [M, N] epilogue inputs at the same
place, e.g. pre-activations kept from a forward pass) to the output tiles, which are stored masked
to the visit's rows; zero-fill visits store zeros, so every output row is written exactly once.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import backend, tile_order, tuning

_SWIZZLE = 8  # visits per swizzle band


def dot_precision(dtype):
  """fp32 inputs use IEEE fp32 products (Triton's default would be TF32)."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def in_bounds(start, size: int, bound: int):
  """[size] bool: start + i < bound; None (no mask) when tiles divide the bound, so that
  Triton keeps vectorised loads along a contiguous dimension."""
  if bound % size == 0:
    return None
  return start + jnp.arange(size, dtype=jnp.int32) < bound


def tile_mask(row_ok, col_ok, shape):
  """[a] and [b] masks (None: all true) -> [a, b] mask, or None."""
  if row_ok is None and col_ok is None:
    return None
  mask = jnp.ones(shape, jnp.bool_)
  if row_ok is not None:
    mask &= row_ok[:, None]
  if col_ok is not None:
    mask &= col_ok[None, :]
  return mask


def load(ref, mask):
  """ref's tile, zero where mask is False."""
  return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)


def store(ref, value, mask):
  plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def _swizzle(pid, num_visits: int, n_tiles: int):
  """Program id -> (visit, N-tile), walking bands of `_SWIZZLE` visits column by column."""
  band = _SWIZZLE * n_tiles
  first = (pid // band) * _SWIZZLE
  height = jnp.minimum(num_visits - first, _SWIZZLE)
  return first + (pid % band) % height, (pid % band) // height


def grouped_matmul(
  lhs: Sequence[jax.Array],
  rhs: Sequence[jax.Array],
  rhs_transposed: Sequence[bool],
  accumulators: Sequence[Sequence[tuple[int, int]]],
  epilogue: Callable[..., Sequence[jax.Array]],
  out_dtypes: Sequence[jnp.dtype],
  visits: tile_order.Visits,
  config: tuning.TileConfig,
  interpret: bool,
  name: str,
  epilogue_inputs: Sequence[jax.Array] = (),
) -> list[jax.Array]:
  """Grouped products with a fused epilogue.

  Args:
    lhs: arrays [M, K] of one dtype, rows grouped as in `visits`.
    rhs: arrays [G, K, N], or [G, N, K] where rhs_transposed, of the lhs dtype.
    accumulators: per accumulator, the (lhs index, rhs index) pairs whose products it sums.
    epilogue: fp32 accumulator tiles [block_m, block_n], then the epilogue inputs' tiles at the
      same rows and columns (as fp32) -> output tiles, one per out_dtypes.
    visits: the visits of the groups for config.block_m.
    epilogue_inputs: arrays [M, N], read only in the epilogue (zero outside the visit's rows).
  Returns:
    outputs [M, N]; rows of the zero-fill pseudo-group are 0.
  """
  m, k = lhs[0].shape
  num_groups = rhs[0].shape[0]
  n = rhs[0].shape[1] if rhs_transposed[0] else rhs[0].shape[2]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  num_visits = visits.group_ids.shape[0]
  n_tiles, k_tiles = pl.cdiv(n, bn), pl.cdiv(k, bk)
  precision = dot_precision(lhs[0].dtype)
  if m == 0 or n == 0:
    return [jnp.zeros((m, n), d) for d in out_dtypes]

  def load_rhs(ref, transposed, g, k0, k_ok, col0, col_ok):
    if transposed:
      return load(ref.at[g, pl.ds(col0, bn), pl.ds(k0, bk)], tile_mask(col_ok, k_ok, (bn, bk)))
    return load(ref.at[g, pl.ds(k0, bk), pl.ds(col0, bn)], tile_mask(k_ok, col_ok, (bk, bn)))

  def kernel(gid_ref, tile_ref, lo_ref, hi_ref, *refs):
    num_mm = len(lhs) + len(rhs)
    num_in = num_mm + len(epilogue_inputs)
    lhs_refs, rhs_refs = refs[: len(lhs)], refs[len(lhs) : num_mm]
    epilogue_refs, out_refs = refs[num_mm:num_in], refs[num_in:]
    visit, j = _swizzle(pl.program_id(0), num_visits, n_tiles)
    g, lo, hi = gid_ref[visit], lo_ref[visit], hi_ref[visit]
    row0 = pl.multiple_of(tile_ref[visit] * bm, bm)
    col0 = pl.multiple_of(j * bn, bn)
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    row_ok = (rows >= lo) & (rows < hi)
    col_ok = in_bounds(col0, bn, n)
    out_ok = tile_mask(row_ok, col_ok, (bm, bn))

    def body(kk, accs):
      k0 = pl.multiple_of(kk * bk, bk)
      k_ok = in_bounds(k0, bk, k)
      lhs_ok = tile_mask(row_ok, k_ok, (bm, bk))
      a = [load(r.at[pl.ds(row0, bm), pl.ds(k0, bk)], lhs_ok) for r in lhs_refs]
      b = [load_rhs(r, t, g, k0, k_ok, col0, col_ok) for r, t in zip(rhs_refs, rhs_transposed)]
      new_accs = []
      for acc, pairs in zip(accs, accumulators):
        for li, ri in pairs:
          contract = ((1,), (1,)) if rhs_transposed[ri] else ((1,), (0,))
          acc += lax.dot_general(
            a[li], b[ri], (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
          )
        new_accs.append(acc)
      return tuple(new_accs)

    @pl.when((lo < hi) & (g < num_groups))
    def _compute():
      zeros = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in accumulators)
      accs = lax.fori_loop(0, k_tiles, body, zeros)
      extra = [load(r.at[pl.ds(row0, bm), pl.ds(col0, bn)], out_ok).astype(jnp.float32) for r in epilogue_refs]
      for ref, tile in zip(out_refs, epilogue(*accs, *extra)):
        store(ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], tile, out_ok)

    @pl.when((lo < hi) & (g == num_groups))
    def _zero_fill():
      for ref in out_refs:
        store(ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], jnp.zeros((bm, bn)), out_ok)

  return pl.pallas_call(
    kernel,
    grid=(num_visits * n_tiles,),
    out_shape=backend.out_shapes([((m, n), d) for d in out_dtypes], *visits, *lhs, *rhs, *epilogue_inputs),
    compiler_params=backend.compiler_params(config),
    interpret=interpret,
    name=name,
  )(*visits, *lhs, *rhs, *epilogue_inputs)
