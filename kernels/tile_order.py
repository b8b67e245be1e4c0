"""Group metadata for grouped matmuls: row ranges of groups and the order in which M-tiles are visited.

Group g owns rows [starts[g], ends[g]) with ends = min(cumsum(group_sizes), m): a sum past m
truncates the last groups at row m, as `jax.lax.ragged_dot` does; negative sizes count as 0.
Rows [ends[-1], m) belong to no group.

A visit is one (group, M-tile) pair. Visits are sorted by group, then tile; a tile that
straddles a group boundary is visited once per group, each visit masked to its rows. The rows
past the last group form pseudo-group G, whose visits write zeros. Each of the G boundaries
between the G + 1 (pseudo-)groups adds at most one visit to the cdiv(m, block_m) tiles, so
`num_visits = cdiv(m, block_m) + G` is a static bound; unused visits have row_lo == row_hi.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


class Visits(NamedTuple):
  """All fields: [num_visits] int32."""

  group_ids: jax.Array  # in [0, G]; G is the zero-fill pseudo-group
  tile_ids: jax.Array  # the visit covers rows [tile * block_m, (tile + 1) * block_m) ...
  row_lo: jax.Array  # ... masked to [row_lo, row_hi)
  row_hi: jax.Array


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """group_sizes: [G] int -> (starts, ends): [G] int32, clamped to [0, m]."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m).astype(jnp.int32)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def make_visits(group_sizes: jax.Array, m: int, block_m: int) -> Visits:
  """group_sizes: [G] int -> Schedule over cdiv(m, block_m) + G visits."""
  num_groups = group_sizes.shape[0]
  num_visits = pl.cdiv(m, block_m) + num_groups
  starts, ends = group_bounds(group_sizes, m)
  starts = jnp.append(starts, ends[-1])
  ends = jnp.append(ends, jnp.int32(m))
  first_tile = starts // block_m
  num_tiles = jnp.where(ends > starts, (ends - 1) // block_m - first_tile + 1, 0)
  visit_end = jnp.cumsum(num_tiles)  # [G + 1]: one past each group's last visit
  visit = jnp.arange(num_visits, dtype=jnp.int32)
  group = jnp.sum(visit[:, None] >= visit_end[None, :], axis=1).astype(jnp.int32)
  used = group <= num_groups
  group = jnp.minimum(group, num_groups)
  tile = first_tile[group] + visit - (visit_end[group] - num_tiles[group])
  row_lo = jnp.maximum(starts[group], tile * block_m)
  row_hi = jnp.minimum(ends[group], (tile + 1) * block_m)
  zero = jnp.zeros_like(visit)
  return Visits(
    group_ids=group,
    tile_ids=jnp.where(used, tile, zero),
    row_lo=jnp.where(used, row_lo, zero),
    row_hi=jnp.where(used, row_hi, zero),
  )
