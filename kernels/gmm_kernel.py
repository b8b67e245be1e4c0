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

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

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


@dataclasses.dataclass(frozen=True)
class _Problem:
  """The static sizes of one call: lhs [M, K], rhs G groups of [K, N] (or [N, K] where transposed), tiles
  [bm, bn] of the output and [.., bk] along K, and which products each accumulator sums."""

  n: int
  k: int
  num_groups: int
  num_visits: int
  bm: int
  bn: int
  bk: int
  rhs_transposed: Sequence[bool]
  accumulators: Sequence[Sequence[tuple[int, int]]]
  precision: lax.Precision | None

  @property
  def n_tiles(self) -> int:
    return pl.cdiv(self.n, self.bn)

  @property
  def k_tiles(self) -> int:
    return pl.cdiv(self.k, self.bk)


class _Tile(NamedTuple):
  """One program's output tile: group `g`, rows row0 + [bm] (`row_ok`: inside the visit's rows [lo, hi)), columns
  col0 + [bn] (`col_ok`: inside N, None where the tiles divide N)."""

  g: jax.Array
  lo: jax.Array
  hi: jax.Array
  row0: jax.Array
  row_ok: jax.Array
  col0: jax.Array
  col_ok: jax.Array | None


def _locate(p: _Problem, gid_ref, tile_ref, lo_ref, hi_ref) -> _Tile:
  """This program's tile, from its swizzled id and the visit's group, row tile and row bounds."""
  visit, j = _swizzle(pl.program_id(0), p.num_visits, p.n_tiles)
  g, lo, hi = gid_ref[visit], lo_ref[visit], hi_ref[visit]
  row0 = pl.multiple_of(tile_ref[visit] * p.bm, p.bm)
  col0 = pl.multiple_of(j * p.bn, p.bn)
  rows = row0 + jnp.arange(p.bm, dtype=jnp.int32)
  return _Tile(g, lo, hi, row0, (rows >= lo) & (rows < hi), col0, in_bounds(col0, p.bn, p.n))


def _load_rhs(p: _Problem, ref, transposed: bool, tile: _Tile, k0, k_ok):
  """Group tile.g's rhs tile at K offset k0 and the tile's columns: [bk, bn], or [bn, bk] where transposed."""
  g, col0, col_ok = tile.g, tile.col0, tile.col_ok
  if transposed:
    return load(ref.at[g, pl.ds(col0, p.bn), pl.ds(k0, p.bk)], tile_mask(col_ok, k_ok, (p.bn, p.bk)))
  return load(ref.at[g, pl.ds(k0, p.bk), pl.ds(col0, p.bn)], tile_mask(k_ok, col_ok, (p.bk, p.bn)))


def _k_step(p: _Problem, tile: _Tile, lhs_refs, rhs_refs, kk, accs: tuple) -> tuple:
  """The fp32 accumulators [bm, bn] plus the products of K-tile `kk`: each pair's lhs tile [bm, bk] times its rhs
  tile."""
  k0 = pl.multiple_of(kk * p.bk, p.bk)
  k_ok = in_bounds(k0, p.bk, p.k)
  lhs_ok = tile_mask(tile.row_ok, k_ok, (p.bm, p.bk))
  a = [load(r.at[pl.ds(tile.row0, p.bm), pl.ds(k0, p.bk)], lhs_ok) for r in lhs_refs]
  b = [_load_rhs(p, r, t, tile, k0, k_ok) for r, t in zip(rhs_refs, p.rhs_transposed)]
  new_accs = []
  for acc, pairs in zip(accs, p.accumulators):
    for li, ri in pairs:
      contract = ((1,), (1,)) if p.rhs_transposed[ri] else ((1,), (0,))
      acc += lax.dot_general(
        a[li], b[ri], (contract, ((), ())), precision=p.precision, preferred_element_type=jnp.float32
      )
    new_accs.append(acc)
  return tuple(new_accs)


def _accumulate(p: _Problem, tile: _Tile, lhs_refs, rhs_refs) -> tuple:
  """The fp32 accumulators [bm, bn] of the tile, summed over every K-tile."""
  zeros = tuple(jnp.zeros((p.bm, p.bn), jnp.float32) for _ in p.accumulators)
  return lax.fori_loop(0, p.k_tiles, lambda kk, accs: _k_step(p, tile, lhs_refs, rhs_refs, kk, accs), zeros)


def _kernel(p: _Problem, epilogue: Callable[..., Sequence[jax.Array]], num_lhs: int, num_rhs: int, num_extra: int):
  """The kernel over refs (the visits' group ids, row tiles, row bounds lo and hi; the lhs, the rhs, the `num_extra`
  epilogue inputs; the outputs): the tile's products through the epilogue, or zeros on a zero-fill visit."""

  def kernel(gid_ref, tile_ref, lo_ref, hi_ref, *refs):
    num_mm = num_lhs + num_rhs
    num_in = num_mm + num_extra
    lhs_refs, rhs_refs = refs[:num_lhs], refs[num_lhs:num_mm]
    epilogue_refs, out_refs = refs[num_mm:num_in], refs[num_in:]
    tile = _locate(p, gid_ref, tile_ref, lo_ref, hi_ref)
    out_ok = tile_mask(tile.row_ok, tile.col_ok, (p.bm, p.bn))
    at = (pl.ds(tile.row0, p.bm), pl.ds(tile.col0, p.bn))

    @pl.when((tile.lo < tile.hi) & (tile.g < p.num_groups))
    def _compute():
      accs = _accumulate(p, tile, lhs_refs, rhs_refs)
      extra = [load(r.at[at], out_ok).astype(jnp.float32) for r in epilogue_refs]
      for ref, out in zip(out_refs, epilogue(*accs, *extra)):
        store(ref.at[at], out, out_ok)

    @pl.when((tile.lo < tile.hi) & (tile.g == p.num_groups))
    def _zero_fill():
      for ref in out_refs:
        store(ref.at[at], jnp.zeros((p.bm, p.bn)), out_ok)

  return kernel


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
  n = rhs[0].shape[1] if rhs_transposed[0] else rhs[0].shape[2]
  if m == 0 or n == 0:
    return [jnp.zeros((m, n), d) for d in out_dtypes]
  p = _Problem(
    n=n,
    k=k,
    num_groups=rhs[0].shape[0],
    num_visits=visits.group_ids.shape[0],
    bm=config.block_m,
    bn=config.block_n,
    bk=config.block_k,
    rhs_transposed=rhs_transposed,
    accumulators=accumulators,
    precision=dot_precision(lhs[0].dtype),
  )
  return pl.pallas_call(
    _kernel(p, epilogue, len(lhs), len(rhs), len(epilogue_inputs)),
    grid=(p.num_visits * p.n_tiles,),
    out_shape=backend.out_shapes([((m, n), d) for d in out_dtypes], *visits, *lhs, *rhs, *epilogue_inputs),
    compiler_params=backend.compiler_params(config),
    interpret=interpret,
    name=name,
  )(*visits, *lhs, *rhs, *epilogue_inputs)
