"""Collectives: what moves one hop's rows to their peers and back (`MoEConfig.collective`).

Three with one signature and one semantics (those of `jax.lax.ragged_all_to_all`): 'ragged' (the native
collective, GPU/TPU), 'padded' (a ring of fixed-size collective permutes, one block in flight: runs on every
backend and is the oracle 'ragged' is checked against) and 'capacity' (one fixed-size all_to_all of a block of
`block_rows` rows per peer: GShard/Switch's dense dispatch, where capacity bounds what a device sends each peer).
'auto' resolves, where the mesh is known, to 'ragged' on a platform that has it, else 'padded' (`resolve`).
The hops themselves, the path, are `moe.path`'s.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import plan as plan_lib
from moejax.moe import wire as wire_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import require

CAPACITY = "capacity"


def padded_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, shifts=None
):
  """`jax.lax.ragged_all_to_all` semantics from a ring of fixed-size collective permutes.

  operand: [R_in, ...]; output: [R_out, ...] (rows not received keep their value). Step s sends my
  block for peer me + s, padded to min(R_in, R_out) rows, with its offset and size; the receiver
  writes the valid rows where the sender said. One block is in flight at a time, so memory stays
  O(local rows) however many peers there are, and the steps are one loop (a switch picks each step's
  permute), so the program does not grow with the peer count either. shifts: the ring steps to run
  (default all; comet runs its own rows, shift 0, apart from the others').
  """
  del recv_sizes  # each block carries its own size
  block = min(operand.shape[0], output.shape[0])
  num_peers = send_sizes.shape[0]
  shifts = tuple(range(num_peers)) if shifts is None else tuple(shifts)
  me = jax.lax.axis_index(axis_name)
  i_J = jnp.arange(block)

  def permute(shift):
    perm = [(i, (i + shift) % num_peers) for i in range(num_peers)]
    return (lambda sent: sent) if shift == 0 else (lambda sent: jax.lax.ppermute(sent, axis_name, perm))

  def step(s, output):
    dest = (me + jnp.asarray(shifts, jnp.int32)[s]) % num_peers
    valid_J = i_J < send_sizes[dest]
    rows = jnp.take(operand, jnp.clip(input_offsets[dest] + i_J, 0, operand.shape[0] - 1), axis=0)
    rows = jnp.where(_expand(valid_J, rows.ndim), rows, jnp.zeros((), operand.dtype))
    where_J = jnp.where(valid_J, output_offsets[dest] + i_J, output.shape[0])  # out of range: dropped
    sent = (rows, where_J)
    rows, where_J = (
      permute(shifts[0])(sent) if len(shifts) == 1 else jax.lax.switch(s, list(map(permute, shifts)), sent)
    )
    return output.at[where_J].set(rows, mode="drop")

  return step(0, output) if len(shifts) == 1 else jax.lax.fori_loop(0, len(shifts), step, output)


def _expand(mask, ndim):
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def dense_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, block_rows: int, shifts=None
):
  """`jax.lax.ragged_all_to_all` semantics from one fixed-size all_to_all: my block for every peer
  padded to `block_rows` rows (GShard's dense dispatch buffer [A, block_rows, ...]), each row sent
  with the place the receiver writes it. A peer's rows past block_rows are not sent: the plan keeps
  send sizes within the block (`plan_path`)."""
  del recv_sizes, shifts  # each block carries its own places; peers outside the shifts send nothing
  i_J = jnp.arange(block_rows)
  valid_AxJ = i_J[None, :] < send_sizes[:, None]
  index_AxJ = jnp.clip(input_offsets[:, None] + i_J[None, :], 0, operand.shape[0] - 1)
  rows = jnp.take(operand, index_AxJ, axis=0)
  rows = jnp.where(_expand(valid_AxJ, rows.ndim), rows, jnp.zeros((), operand.dtype))
  where_AxJ = jnp.where(valid_AxJ, output_offsets[:, None] + i_J[None, :], output.shape[0])
  rows, where_AxJ = jax.lax.all_to_all((rows, where_AxJ), axis_name, 0, 0)
  return output.at[where_AxJ.reshape(-1)].set(rows.reshape((-1,) + operand.shape[1:]), mode="drop")


def _ragged_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, shifts=None
):
  del shifts  # the sizes of the peers outside the shifts are zero (plan.shift_args)
  return jax.lax.ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
  )


EXCHANGES = {"ragged": _ragged_all_to_all, "padded": padded_all_to_all}


class Collective(NamedTuple):
  """One value of `MoEConfig.collective` ('padded' | 'ragged' | 'capacity' | 'auto'), or a resolved one with the
  capacity blocks' rows per peer (of a flat hop; `moe.path.hop_sizes` scales it for the hops of a longer path)."""

  name: str
  block_rows: int | None = None

  @property
  def fixed_blocks(self) -> bool:
    """Whether every peer is sent a block of fixed rows (whatever it holds): 'capacity'."""
    return self.name == CAPACITY

  @property
  def native_ragged(self) -> bool:
    """Whether it is the platform's own ragged all-to-all, which not every platform has."""
    return self.name == "ragged"

  @property
  def ring_of_permutes(self) -> bool:
    """Whether it moves rows by a ring of collective permutes ('padded'): one XLA collective over every device of the
    program, so devices that run different code at one time (pipeline stages) would wait on each other."""
    return self.name == "padded"

  @property
  def per_platform(self) -> bool:
    """Whether it names no collective of its own but the platform's best ('auto', `resolve`)."""
    return self.name == "auto"

  def resolve(self, platform: str) -> "Collective":
    """The collective this one runs as on `platform`: 'auto' is 'ragged' where the platform has it, else 'padded'."""
    if not self.per_platform:
      return self
    return COLLECTIVES["ragged" if platform_lib.has_ragged_all_to_all(platform) else "padded"]

  def runs_on(self, platform: str) -> bool:
    """Whether it runs on `platform` (every one but 'ragged' runs everywhere)."""
    return not self.native_ragged or platform_lib.has_ragged_all_to_all(platform)

  def check(self, cfg) -> None:
    """Raises ConfigError naming the field where the config does not fit this collective."""
    cf = cfg.capacity_factor
    require(
      not self.fixed_blocks or cf is not None,
      "capacity_factor",
      cf,
      f"a number > 0 when collective={self.name!r} (dense dispatch has fixed capacity)",
    )


COLLECTIVES = {c.name: c for c in map(Collective, ("padded", "ragged", "capacity", "auto"))}
# The native ragged exchange and the ring of permutes with its semantics, its oracle: the pair benchmarks compare.
RAGGED_AND_ORACLE = (COLLECTIVES["ragged"].name, COLLECTIVES["padded"].name)


def of(cfg) -> Collective:
  """The collective of `cfg.collective` (unresolved)."""
  return COLLECTIVES[cfg.collective]


def as_collective(collective) -> Collective:
  return collective if isinstance(collective, Collective) else Collective(collective)


def resolve(name: str, platform: str) -> str:
  """The collective `name` runs as on `platform`: 'auto' is 'ragged' where the platform has it, else 'padded'."""
  return COLLECTIVES[name].resolve(platform).name


def runs_on(name: str, platform: str) -> bool:
  """Whether the collective `name` runs on `platform` (every one but 'ragged' runs everywhere)."""
  return COLLECTIVES[name].runs_on(platform)


def check(name: str, platform: str, field: str = "collective") -> None:
  """Raises ConfigError naming `field` if the collective cannot run on `platform`."""
  require(
    runs_on(name, platform),
    field,
    name,
    f"not 'ragged' on {platform}: XLA:{platform.upper()} has no ragged all-to-all; use {field}='padded' "
    "(the same semantics from fixed-size collective permutes) or 'auto'",
  )


def exchange(operand, args: plan_lib.RaggedArgs, out_rows: int, axis_name, collective, fill=0, like=None, shifts=None):
  """One ragged exchange of `operand` [R_in, ...] into a fresh [out_rows, ...] buffer filled with `fill`.

  The buffer takes its mesh-axis variance from `like` (default: the operand): ragged_all_to_all's
  result has the buffer's type, and a custom_vjp backward must return its primal input's exact type.
  shifts: with args from `plan.shift_args`, the ring steps whose peers have rows (others send none).
  collective: a collective's name or `Collective`.
  """
  collective = as_collective(collective)
  like = operand if like is None else like
  output = jnp.full_like(like, fill, operand.dtype, shape=(out_rows,) + operand.shape[1:])
  # With one peer the exchange is a local move, never the collective: XLA:GPU's ragged_all_to_all took
  # 20-100 ms for it on one H100 where a local gather/scatter took 0.5-1.8 ms
  # (benchmarks/results/2026-11-23-h100). My only peer is me: both offsets are 0, the rows stay in place.
  if args.send_sizes.shape[0] == 1:
    return _keep_first(operand, args.send_sizes[0], output)
  local = shifts == (0,)  # a self-only step (comet's own rows) moves within my buffers too
  if collective.fixed_blocks and not local:
    move = functools.partial(dense_all_to_all, block_rows=collective.block_rows)
  else:
    move = padded_all_to_all if local else EXCHANGES[collective.name]
  return move(
    operand,
    output,
    args.input_offsets,
    args.send_sizes,
    args.output_offsets,
    args.recv_sizes,
    axis_name=axis_name,
    shifts=shifts,
  )


def _keep_first(operand, rows, output):
  """The exchange along an axis of one device: output [R_out, ...] with operand's first `rows` rows in place, in
  one elementwise pass (the ring's gather and scatter would each be a pass over the rows)."""
  out_rows = output.shape[0]
  operand = (
    operand[:out_rows]
    if operand.shape[0] >= out_rows
    else jnp.concatenate([operand, jnp.zeros((out_rows - operand.shape[0],) + operand.shape[1:], operand.dtype)])
  )
  return jnp.where(_expand(jnp.arange(out_rows) < rows, operand.ndim), operand, output)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def move_rows(
  rows,
  args: plan_lib.RaggedArgs,
  back: plan_lib.RaggedArgs,
  out_rows: int,
  axis_name,
  collective,
  shifts=None,
  wire=(None, None),
):
  """`exchange` of float rows [R_in, d] -> [out_rows, d] whose backward is the reverse exchange with
  the forward's own sizes (`back`), not the generic transpose (which exchanges the offsets again).
  wire: the dtypes (`moe.wire`) the rows travel in, and their gradients in the backward (None: their own)."""
  return _wired(rows, args, out_rows, axis_name, collective, shifts, wire[0], like=rows)


def _wired(rows, args, out_rows, axis_name, collective, shifts, dtype, like):
  """`exchange` of rows encoded in `dtype` on the wire, decoded into like's dtype."""
  sent = wire_lib.encode(rows, dtype)
  got = exchange(sent, args, out_rows, axis_name, collective, like=like[:, :0], shifts=shifts)
  return wire_lib.decode(got, dtype, rows.shape[1], like.dtype)


def _move_rows_fwd(rows, args, back, out_rows, axis_name, collective, shifts, wire):
  like = rows[:, :0]  # no data: the operand's row count, dtype and varying axes
  return move_rows(rows, args, back, out_rows, axis_name, collective, shifts, wire), (back, like)


def _move_rows_bwd(out_rows, axis_name, collective, shifts, wire, residuals, grad):
  back, like = residuals
  del out_rows
  num_peers = back.send_sizes.shape[0]
  reverse = None if shifts is None else tuple((-s) % num_peers for s in shifts)
  dtype = like.dtype if wire[1] is None else wire[1]  # None: the gradient travels in the rows' own dtype
  grad_in = _wired(grad, back, like.shape[0], axis_name, collective, reverse, dtype, like=like)
  return grad_in, None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def hop_buffer_rows(rows_in: int, num_peers: int, max_rows: int, buffer_rows: int | None) -> int:
  """Receive buffer of one hop: what all its peers could send (at most `max_rows`, all rows of all
  devices), bounded by `buffer_rows` when given."""
  worst = min(num_peers * rows_in, max_rows)
  return worst if buffer_rows is None else min(worst, buffer_rows)


def buffer_bound(buffer_factor: float | None, local_rows: int) -> int | None:
  """Rows every hop may receive with `MoEConfig.buffer_factor` (None: unbounded, the worst case)."""
  return None if buffer_factor is None else math.ceil(buffer_factor * local_rows)
