"""Paths: rows through a path's hops to their experts' devices and back, one row per destination.

The path (`MoEConfig.path`, `PATHS`) is the hops a row takes, each an exchange over one mesh axis or both at once:
'flat' one hop over ('node', 'gpu'); 'gpu_first' over 'gpu', then 'node' (Tutel-2DH, DeepSpeed's hierarchical
all-to-all); 'node_first' over 'node' to the same GPU index of the expert's node, then over 'gpu' (SMILE's path,
DeepEP's internode one). Each hop's rows move by the configured collective (`moe.collective`).

A row is a payload x [d] with Z slots: the device-level expert (slot) ids it goes to ([Z], -1 = none) and
their combine weights [Z]. In each hop a row travels at most once to each peer its slots go to: its slots are
grouped by that peer, and each group (an *entry*: the row and the mask of its slots for that peer) moves as
one row, carrying the ids and weights of those slots (deduplicated dispatch; without `dedup` every slot is its
own entry). The way back is the mirror: each hop sums the entries that came from one row (reduced combine).
With one slot per row (a token-choice per row) this is the plain per-choice exchange.

`plan_path` plans every hop at once, moving only the ids; `move_through` / `move_slots` / `move_back` then move
the payload, the weights and the results along the planned path. Each hop receives into a buffer of fixed rows:
the worst case, or a bound (`MoEConfig.buffer_factor`) under which entries that do not fit are dropped
deterministically (`plan.clamp_to_buffer`); the 'capacity' collective receives every peer's block, sized for the
hop (`hop_sizes`).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moejax.moe import collective as collective_lib
from moejax.moe import plan as plan_lib
from moejax.runtime import mesh as mesh_lib

# The name of every row an exchange delivers, so a rematerialised block can keep them (remat="save_exchanged").
EXCHANGED = "moe_exchanged"


class PathKind(NamedTuple):
  """One value of `MoEConfig.path`: its name and its hops, each a mesh axis or both axes as one, in order."""

  name: str
  hops: tuple

  @property
  def crosses_axes_apart(self) -> bool:
    """Whether it takes more than one hop (an intra-node and an inter-node one), not one over both axes."""
    return len(self.hops) > 1

  def check(self, cfg) -> None:
    """Every path runs with every routing, collective and schedule: nothing to refuse."""


PATHS = {
  kind.name: kind
  for kind in (
    PathKind("flat", ((mesh_lib.NODE, mesh_lib.GPU),)),
    PathKind("gpu_first", (mesh_lib.GPU, mesh_lib.NODE)),
    PathKind("node_first", (mesh_lib.NODE, mesh_lib.GPU)),
  )
}


def of(cfg) -> PathKind:
  """The path of `cfg.path`."""
  return PATHS[cfg.path]


def hops(path: str) -> tuple:
  """The hops (each a mesh axis, or both axes as one) of the path `path`, in order."""
  return PATHS[path].hops


class Spread(NamedTuple):
  """How the Y = R x Z entries of R rows with Z slots are laid out for one move or for the experts.

  order [Y] sorts the entries (those that may move first), inverse [Y] is its inverse; the first `taken`
  sorted entries, Q, are all that may move. dense: gather them by repeating each row Z times and permuting, so
  neither direction scatters (used while R x Z stays within the bound on entries, so it costs no more memory
  than one row per entry); else by row index (a gather whose transpose adds rows up)."""

  order: jax.Array
  inverse: jax.Array
  rows: int
  slots: int
  taken: int
  dense: bool

  @property
  def row_Q(self) -> jax.Array:
    """[Q] the row of each taken entry."""
    return self.order[: self.taken] // self.slots

  def expand(self, x_RxX: jax.Array) -> jax.Array:
    """Each taken entry's row: x [R, ...] -> [Q, ...] in sorted entry order."""
    if not self.dense:
      return jnp.take(x_RxX, self.row_Q, axis=0)
    x_YxX = jnp.repeat(x_RxX, self.slots, axis=0) if self.slots > 1 else x_RxX
    if jnp.issubdtype(x_YxX.dtype, jnp.integer):
      return x_YxX[self.order[: self.taken]]
    return plan_lib.permute_rows(x_YxX, self.order, self.inverse)[: self.taken]

  def reduce(self, y_QxX: jax.Array) -> jax.Array:
    """The mirror of `expand`: each row's entries summed, y [Q, ...] -> [R, ...]."""
    if not self.dense:
      return jax.ops.segment_sum(y_QxX, self.row_Q, num_segments=self.rows)
    entries = self.rows * self.slots
    y_YxX = jnp.concatenate([y_QxX, jnp.zeros((entries - self.taken,) + y_QxX.shape[1:], y_QxX.dtype)])
    if jnp.issubdtype(y_YxX.dtype, jnp.integer):
      y_YxX = y_YxX[self.inverse]
    else:
      y_YxX = plan_lib.permute_rows(y_YxX, self.inverse, self.order)
    return y_YxX.reshape((self.rows, self.slots) + y_QxX.shape[1:]).sum(axis=1) if self.slots > 1 else y_YxX


def grouped(key_Y: jax.Array, rows: int, slots: int, groups: int, bound: int) -> tuple[Spread, jax.Array]:
  """The entries of R rows with Z slots sorted by their group key [Y] (key == groups: empty), at most `bound`
  of them non-empty -> (Spread, group sizes [groups])."""
  order = jnp.argsort(key_Y, stable=True)
  taken = min(rows * slots, bound)
  spread = Spread(order, plan_lib.inverse_permutation(order), rows, slots, taken, rows * slots <= bound)
  return spread, plan_lib.histogram(key_Y, groups)


class Hop(NamedTuple):
  """One planned hop: its mesh axis (or both), the plan of its entries, their spread, mask [Q, Z] of the slots each
  taken entry carries, the receive buffer's rows and the hop's collective (`HopSize.collective`)."""

  axis: object
  plan: plan_lib.HopPlan
  spread: Spread
  mask_QxZ: jax.Array
  out_rows: int
  collective: collective_lib.Collective


class Path(NamedTuple):
  """What `plan_path` leaves for the moves: one `Hop` per hop, and the bound on the slots that can arrive at a
  device (the experts' entries)."""

  hops: tuple
  bound: int


def hop_destination(expert_ids, axis_name, slots_per_device: int, gpus_per_node: int, num_peers: int):
  """Peer index along `axis_name` towards each slot's expert; num_peers for ids -1."""
  dest = mesh_lib.peer_index(expert_ids // slots_per_device, axis_name, gpus_per_node)
  return jnp.where(expert_ids >= 0, dest, num_peers)


def _leaders(dest_RxZ, valid_RxZ, dedup: bool):
  """[R, Z] bool: the slots that start an entry: with dedup the first slot of a row towards each peer."""
  if not dedup:
    return valid_RxZ
  slots = dest_RxZ.shape[1]
  earlier_ZxZ = jnp.arange(slots)[None, :] < jnp.arange(slots)[:, None]  # [s, s']: s' before s
  same_RxZxZ = (dest_RxZ[:, :, None] == dest_RxZ[:, None, :]) & valid_RxZ[:, None, :] & earlier_ZxZ
  return valid_RxZ & ~same_RxZxZ.any(axis=2)


class HopSize(NamedTuple):
  """The static sizes of one hop: peers, rows and slots before it, entries that may move (`Spread.taken`),
  whether they spread densely, the receive buffer's rows, the bound on the slots a device holds after it, and the
  hop's collective ('capacity' with this hop's block rows)."""

  num_peers: int
  rows: int
  taken: int
  dense: bool
  out_rows: int
  bound: int
  collective: collective_lib.Collective


def hop_sizes(
  hops, axis_sizes: dict, rows: int, slots: int, collective, buffer_rows: int | None = None, dedup: bool = True
) -> list[HopSize]:
  """The sizes of each hop for R rows with Z slots per device (plain Python, before tracing). A hop's entries
  are at most R x min(Z, peers) with dedup (R x Z without) and at most the slots the device can hold; its
  buffer holds what its peers could send (at most every slot of every device), bounded by `buffer_rows` (rows,
  and the slots they bring: per-device memory stays flat in the device count), or with 'capacity' a block per
  peer: the collective's block (one source to one device's slots) times the sources whose rows a device holds
  before the hop (the peers of the hops before it) and the devices a peer passes them on to (of the hops after
  it), so no hop drops what capacity kept, and every hop's buffer holds A flat blocks, as a flat hop's does."""
  n, m = axis_sizes[mesh_lib.NODE], axis_sizes[mesh_lib.GPU]
  collective = collective_lib.as_collective(collective)
  peers = [mesh_lib.num_peers(axis_name, n, m) for axis_name in hops]
  max_rows = n * m * rows * slots  # every slot of every device
  bound = rows * slots  # slots this device may hold before the hop
  sizes = []
  for h, num_peers in enumerate(peers):
    taken = min(rows * (min(slots, num_peers) if dedup else slots), bound)
    hop_collective = collective
    if collective.fixed_blocks:  # a block holds a peer's choices for its slots (capacity bounds them)
      block = collective.block_rows * math.prod(peers[:h]) * math.prod(peers[h + 1 :])
      hop_collective = collective._replace(block_rows=block)
      out_rows = arriving = num_peers * block
    else:
      out_rows = collective_lib.hop_buffer_rows(taken, num_peers, max_rows, buffer_rows)
      arriving = out_rows * slots if buffer_rows is None else buffer_rows
    after = min(num_peers * bound, max_rows, arriving)
    sizes.append(HopSize(num_peers, rows, taken, rows * slots <= bound, out_rows, after, hop_collective))
    rows, bound = out_rows, after
  return sizes


def plan_path(
  ids_RxZ, hops, axis_sizes: dict, slots_per_device: int, collective, buffer_rows: int | None = None, dedup: bool = True
) -> tuple[jax.Array, Path]:
  """Plans every hop of sending each row's slots (device-level ids [R, Z]; -1 = none) to their experts'
  devices (`hop_sizes`), moving only the ids. Returns (ids [R_out, Z] as received at the end, -1 on empty
  slots, path). Entries that do not fit a receive buffer are dropped (`HopPlan.kept_AxA`)."""
  m = axis_sizes[mesh_lib.GPU]
  rows, slots = ids_RxZ.shape
  sizes = hop_sizes(hops, axis_sizes, rows, slots, collective, buffer_rows, dedup)
  planned = []
  for axis_name, size in zip(hops, sizes):
    dest_RxZ = hop_destination(ids_RxZ, axis_name, slots_per_device, m, size.num_peers)
    valid_RxZ = ids_RxZ >= 0
    dest_Y = jnp.where(_leaders(dest_RxZ, valid_RxZ, dedup), dest_RxZ, size.num_peers).reshape(-1)
    block = size.collective.block_rows if size.collective.fixed_blocks else None
    plan = plan_lib.make_hop_plan(dest_Y, axis_name, size.num_peers, size.out_rows, block)
    spread = Spread(plan.order, plan.inverse, size.rows, slots, size.taken, size.dense)
    row_Q, dest_Q = spread.row_Q, dest_Y[plan.order[: size.taken]]
    if dedup:
      mask_QxZ = (dest_RxZ[row_Q] == dest_Q[:, None]) & valid_RxZ[row_Q]
    else:
      slot_Q = plan.order[: size.taken] % slots
      mask_QxZ = (jnp.arange(slots)[None, :] == slot_Q[:, None]) & (dest_Q < size.num_peers)[:, None]
    ids_QxZ = jnp.where(mask_QxZ, ids_RxZ[row_Q], -1)
    ids_RxZ = collective_lib.exchange(ids_QxZ, plan.forward, size.out_rows, axis_name, size.collective, fill=-1)
    if buffer_rows is not None and block is None and slots > 1:  # the bound holds slots too: later ones drop
      valid_RxZ = ids_RxZ >= 0
      fits_RxZ = jnp.cumsum(valid_RxZ.reshape(-1)).reshape(valid_RxZ.shape) <= buffer_rows
      ids_RxZ = jnp.where(fits_RxZ, ids_RxZ, -1)
    planned.append(Hop(axis_name, plan, spread, mask_QxZ, size.out_rows, size.collective))
  return ids_RxZ, Path(tuple(planned), sizes[-1].bound)


def move_through(x_RxD, path: Path, num_hops: int | None = None, wire=(None, None)):
  """Moves rows [R, d] along the first `num_hops` hops (default all) of a planned path: each entry takes its
  row's payload. wire: the dtypes of the rows and of their gradients on the wire (`moe.wire`)."""
  for hop in path.hops[:num_hops]:
    x_RxD = checkpoint_name(
      collective_lib.move_rows(
        hop.spread.expand(x_RxD), hop.plan.forward, hop.plan.backward, hop.out_rows, hop.axis, hop.collective, wire=wire
      ),
      EXCHANGED,
    )
  return x_RxD


def move_slots(w_RxZ, path: Path, num_hops: int | None = None):
  """Moves per-slot values [R, Z] (the combine weights) along the path: each entry takes its slots' values,
  0 on the others."""
  for hop in path.hops[:num_hops]:
    w_QxZ = jnp.where(hop.mask_QxZ, jnp.take(w_RxZ, hop.spread.row_Q, axis=0), jnp.zeros((), w_RxZ.dtype))
    w_RxZ = checkpoint_name(
      collective_lib.move_rows(w_QxZ, hop.plan.forward, hop.plan.backward, hop.out_rows, hop.axis, hop.collective),
      EXCHANGED,
    )
  return w_RxZ


def move_back(y_RxX, path: Path, num_hops: int | None = None, wire=(None, None)):
  """The mirror of `move_through` over the last `num_hops` hops (default all): each entry's result returns to
  the device it came from, where a row's entries are summed; entries dropped on the way come back as zeros.
  Integer rows move without a gradient rule; wire as in `move_through`."""
  todo = path.hops if num_hops is None else path.hops[len(path.hops) - num_hops :]
  for hop in reversed(todo):
    if jnp.issubdtype(y_RxX.dtype, jnp.integer):
      back_QxX = collective_lib.exchange(y_RxX, hop.plan.backward, hop.spread.taken, hop.axis, hop.collective)
    else:
      back_QxX = checkpoint_name(
        collective_lib.move_rows(
          y_RxX, hop.plan.backward, hop.plan.forward, hop.spread.taken, hop.axis, hop.collective, wire=wire
        ),
        EXCHANGED,
      )
    y_RxX = hop.spread.reduce(back_QxX)
  return y_RxX


def arrived(ids_out_RxZ, path: Path) -> jax.Array:
  """[R, Z] bool, at the sender: the slot reached its expert (was not dropped on any hop). Each slot rides in
  exactly one entry per hop, so the entries' sums are the slots' own flags."""
  return move_back((ids_out_RxZ >= 0).astype(jnp.int32), path) > 0
