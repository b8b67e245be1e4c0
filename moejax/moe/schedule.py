"""Schedules: the order in which one device's exchanges and expert compute run (Comet; SMILE A.2).

All three move the same rows along the same planned path (`path.plan_path`: rows with slots, one entry per
destination of each hop) and give the same result, drops included. The experts weight their outputs by the
slots' combine weights and sum each row's slots, so each row comes back as one weighted sum (`path.move_back`
adds a row's entries on the way):
- sequential: dispatch every row, run the experts, combine.
- chunked: the rows a device sends in `num_chunks` contiguous chunks, each dispatched, computed and
  combined on its own (Tutel/FasterMoE's coarse pipeline). With collective='capacity'
  every chunk sends full blocks, so the padding grows with num_chunks. No chunk's exchange depends on another chunk's
  matmuls, so XLA may overlap them; the cost is num_chunks times as many, smaller, exchanges. With
  bounded buffers the drops are decided once, on the ids, by the sequential path (one more round
  trip of int32 ids), so every chunk drops exactly what sequential drops and no chunk overflows.
- comet: decomposed by the consumers' independent dimensions (Comet sec. 3.1). The last dispatch hop
  runs in two steps: my own rows (a local move) enter the first expert GEMM at once while the other
  peers' rows arrive in one exchange; hidden rows land in an expert-major buffer (entries ordered by
  (expert, source)). The second GEMM then runs one column block of d at a time for all local
  experts, and each block is sent back through every hop as soon as it is done.
Where a hop may drop entries (bounded buffers, the capacity collective's blocks), which slots arrive is learnt first by
one round trip of int32 flags, so that a choice whose copies (expert sharding's Dump) did not all arrive gets
weight 0 everywhere before any row moves: it contributes exactly nothing, and is counted by the layer.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import collective as collective_lib
from moejax.moe import path as path_lib
from moejax.moe import plan as plan_lib
from moejax.moe.local_experts import Experts
from moejax.validation import require


class Exchange(NamedTuple):
  """Where rows go: the hops, the mesh's axis sizes {'node': n, 'gpu': m}, expert slots per device (an
  id's device is id // slots_per_device), the collective ('ragged' | 'padded' | a `collective.Collective`),
  the per-hop receive bound (None: the worst case, or the capacity collective's blocks), whether a row travels once
  per destination of a hop (dedup), how many consecutive slots are the copies of one choice (the Dump), and
  the wire dtypes (dispatch, combine; None: the rows' own)."""

  hops: tuple
  axis_sizes: dict
  slots_per_device: int
  collective: object
  buffer_rows: int | None
  dedup: bool = True
  copies: int = 1
  wire: tuple = (None, None)

  @property
  def dispatch_wire(self) -> tuple:
    """The rows' dtype to the experts, and their gradients' (`moe.wire`)."""
    return self.wire

  @property
  def combine_wire(self) -> tuple:
    """The results' dtype back from the experts, and their gradients'."""
    return self.wire[1], self.wire[1]


class Result(NamedTuple):
  """y [R, d] fp32 in the input row order: each row's weighted sum over its slots that reached their experts;
  arrived [R, Z] bool: the slot reached its expert (sent, and not dropped by a full receive buffer); the
  paths whose kept entries moved (traffic)."""

  y_RxD: jax.Array
  arrived_RxZ: jax.Array
  paths: tuple


def local_experts(ids, ex: Exchange):
  """The local expert of each received slot; slots_per_device for empty ones (sorts them last). A slot at its
  device has an id in [device * G, (device + 1) * G), so the id mod G is its local expert."""
  return jnp.where(ids >= 0, ids % ex.slots_per_device, ex.slots_per_device)


def plan(ids_RxZ, ex: Exchange):
  """The path of rows with device-level slot ids [R, Z] through the exchange's hops -> (ids at arrival, path)."""
  return path_lib.plan_path(
    ids_RxZ, ex.hops, ex.axis_sizes, ex.slots_per_device, ex.collective, ex.buffer_rows, ex.dedup
  )


def run_experts(rows_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, bound: int):
  """The local experts on received rows in any order: each slot's expert output times its weight, summed over
  the row's slots -> [R, d] fp32 (0 on rows without a slot here). bound: the slots that can be here."""
  rows, slots = ids_RxZ.shape
  spread, group_sizes = path_lib.grouped(
    local_experts(ids_RxZ.reshape(-1), ex), rows, slots, ex.slots_per_device, bound
  )
  w_Q = w_RxZ.reshape(-1)[spread.order[: spread.taken]]
  return spread.reduce(local.weighted(spread.expand(rows_RxD), group_sizes, w_Q))


def may_drop(ex: Exchange) -> bool:
  """Whether a hop may drop entries: a bounded receive buffer, or the capacity collective's blocks (it sends a
  peer no more than a block, however the layer sized it)."""
  return ex.buffer_rows is not None or collective_lib.as_collective(ex.collective).fixed_blocks


def _arrival(ids_RxZ, w_RxZ, ids_out, path, ex: Exchange):
  """(weights, arrived [R, Z]): where a hop may drop entries, the slots that arrive (one round trip of int32
  flags), and the weights with every copy of a choice zeroed unless all its copies arrive."""
  if not may_drop(ex):
    return w_RxZ, ids_RxZ >= 0
  arrived_RxZ = path_lib.arrived(ids_out, path)
  if ex.copies > 1:  # consecutive slots (or rows of one slot) are one choice's copies
    complete = jnp.repeat(arrived_RxZ.reshape(-1, ex.copies).all(axis=1), ex.copies).reshape(arrived_RxZ.shape)
    w_RxZ = jnp.where(complete, w_RxZ, jnp.zeros((), w_RxZ.dtype))
  return w_RxZ, arrived_RxZ


def _round_trip(x_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, decided: bool = False):
  """Dispatch, experts, combine -> (y [R, d], arrived [R, Z], path). decided: the drops were decided before
  (every slot sent arrives)."""
  ids_out, path = plan(ids_RxZ, ex)
  if decided:
    arrived_RxZ = ids_RxZ >= 0
  else:
    w_RxZ, arrived_RxZ = _arrival(ids_RxZ, w_RxZ, ids_out, path, ex)
  rows_RxD = path_lib.move_through(x_RxD, path, wire=ex.dispatch_wire)
  w_out = path_lib.move_slots(w_RxZ, path)
  y_RxD = run_experts(rows_RxD, ids_out, w_out, ex, local, path.bound)
  return path_lib.move_back(y_RxD, path, wire=ex.combine_wire), arrived_RxZ, path


def sequential(x_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, num_chunks: int = 1) -> Result:
  """Dispatch, experts, combine. x [R, d]; ids [R, Z] device-level slot ids (-1 = none); w [R, Z] weights."""
  del num_chunks
  y_RxD, arrived_RxZ, path = _round_trip(x_RxD, ids_RxZ, w_RxZ, ex, local)
  return Result(y_RxD, arrived_RxZ, (path,))


def chunked(x_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, num_chunks: int) -> Result:
  """`sequential` on num_chunks contiguous chunks of rows; where a hop may drop, the drops are decided once by
  the sequential path, so no chunk drops (a chunk's entries fit wherever all of them fit)."""
  arrived_RxZ = ids_RxZ >= 0
  if may_drop(ex):
    ids_out, path = plan(ids_RxZ, ex)
    w_RxZ, arrived_RxZ = _arrival(ids_RxZ, w_RxZ, ids_out, path, ex)
    ids_RxZ = jnp.where(arrived_RxZ, ids_RxZ, -1)
  split = lambda a: jnp.split(a, num_chunks)
  parts = [
    _round_trip(x, ids, w, ex, local, decided=True) for x, ids, w in zip(split(x_RxD), split(ids_RxZ), split(w_RxZ))
  ]
  return Result(jnp.concatenate([y for y, _, _ in parts]), arrived_RxZ, tuple(path for _, _, path in parts))


def _last_hop_steps(operand_QxD, last, me, ex: Exchange) -> list[tuple]:
  """The last hop's rows in two steps, each (rows [J, d] received, their places [J] in the receive layout, valid
  [J]): my own rows first (a local move: they enter the first GEMM at once) while the others arrive in one
  exchange. Two steps, not one per peer: their buffers (my rows, and the receive buffer) do not grow with the peer
  count, where a block per peer alive at once would."""
  axis, out_rows, num_peers = last.axis, last.out_rows, last.plan.sizes_AxA.shape[0]
  recv_offsets, recv_sizes = last.plan.backward.input_offsets, last.plan.forward.recv_sizes
  own_forward, own_backward = plan_lib.shift_args(last.plan.forward, last.plan.backward, 0, me)
  own = min(last.spread.taken, out_rows)
  i_J = jnp.arange(own)
  q_J = jnp.minimum(recv_offsets[me] + i_J, out_rows - 1)  # the rows' places in the receive layout
  steps = [
    (
      collective_lib.move_rows(
        operand_QxD, own_forward, own_backward, own, axis, last.collective, (0,), ex.dispatch_wire
      ),
      q_J,
      i_J < recv_sizes[me],
    )
  ]
  if num_peers > 1:
    forward, backward = plan_lib.without_self(last.plan.forward, last.plan.backward, me)
    q_R = jnp.arange(out_rows)
    mine = (q_R >= recv_offsets[me]) & (q_R < recv_offsets[me] + recv_sizes[me])
    steps.append(
      (
        collective_lib.move_rows(
          operand_QxD, forward, backward, out_rows, axis, last.collective, tuple(range(1, num_peers)), ex.dispatch_wire
        ),
        q_R,
        ~mine,
      )
    )
  return steps


def _first_gemm(steps: list[tuple], ids_out, spread, slots: int, ex: Exchange, local: Experts, bound):
  """The first GEMM's hidden rows [Q, F] in the layer's expert-major order (`spread`), run step by step as the
  rows arrive (`_last_hop_steps`); ids_out [R', Z] the received rows' slot ids."""
  groups, h_QxF = ex.slots_per_device, None
  for x_JxD, q_J, valid_J in steps:
    key_J = local_experts(jnp.where(valid_J[:, None], ids_out[q_J], -1).reshape(-1), ex)
    step, step_sizes = path_lib.grouped(key_J, q_J.shape[0], slots, groups, bound)
    h_step_QxF = local.hidden(step.expand(x_JxD), step_sizes)  # the step's entries, expert-major
    entry_Q = step.order[: step.taken]
    place_Q = spread.inverse[q_J[entry_Q // slots] * slots + entry_Q % slots]  # where they sit in the layer's
    if h_QxF is None:
      h_QxF = jnp.zeros((spread.taken, h_step_QxF.shape[1]), h_step_QxF.dtype)
    h_QxF = h_QxF.at[jnp.where(key_J[entry_Q] < groups, place_Q, spread.taken)].set(h_step_QxF, mode="drop")
  return h_QxF


def _second_gemm_back(h_QxF, w_out, spread, group_sizes, path, ex: Exchange, local: Experts, d: int, num_chunks: int):
  """[R, d]: the second GEMM, weighted and reduced per row, and the way back, by num_chunks column blocks of d."""
  w_Q = w_out.reshape(-1)[spread.order[: spread.taken]][:, None].astype(jnp.float32)
  width = d // num_chunks
  blocks = [
    path_lib.move_back(
      spread.reduce(local.output(h_QxF, group_sizes, slice(j * width, (j + 1) * width)) * w_Q),
      path,
      wire=ex.combine_wire,
    )
    for j in range(num_chunks)
  ]
  return jnp.concatenate(blocks, axis=1)


def comet(x_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, num_chunks: int) -> Result:
  """Comet's decomposition; num_chunks column blocks of d in the second GEMM and the way back."""
  ids_out, path = plan(ids_RxZ, ex)
  w_RxZ, arrived_RxZ = _arrival(ids_RxZ, w_RxZ, ids_out, path, ex)
  last = path.hops[-1]
  slots = ids_RxZ.shape[1]
  me = jax.lax.axis_index(last.axis)
  # Earlier hops move whole; the last one, which feeds the GEMM, in two steps.
  operand_QxD = last.spread.expand(path_lib.move_through(x_RxD, path, len(path.hops) - 1, wire=ex.dispatch_wire))
  w_out = path_lib.move_slots(w_RxZ, path)
  spread, group_sizes = path_lib.grouped(
    local_experts(ids_out.reshape(-1), ex), last.out_rows, slots, ex.slots_per_device, path.bound
  )
  steps = _last_hop_steps(operand_QxD, last, me, ex)
  h_QxF = _first_gemm(steps, ids_out, spread, slots, ex, local, path.bound)
  y_RxD = _second_gemm_back(h_QxF, w_out, spread, group_sizes, path, ex, local, x_RxD.shape[1], num_chunks)
  return Result(y_RxD, arrived_RxZ, (path,))


class Schedule:
  """One value of `MoEConfig.schedule`: its name, what it splits and how it runs (`run`). overlaps: its exchanges
  may run under the expert matmuls (anything but sequential); splits_rows: it runs num_chunks chunks of the rows a
  device sends apart (chunked); splits_columns: its second GEMM and the way back run by num_chunks column blocks
  of d (comet), its first GEMM on rows as they arrive, before their weights are gathered (it weights the second
  GEMM's output: not the experts' inputs, `MoEConfig.weight_inputs`)."""

  def __init__(self, name: str, run, overlaps: bool = False, splits_rows: bool = False, splits_columns: bool = False):
    self.name, self._run = name, run
    self.overlaps, self.splits_rows, self.splits_columns = overlaps, splits_rows, splits_columns

  def check(self, cfg) -> None:
    """Raises ConfigError naming the field where the config does not fit this schedule."""
    require(
      not self.splits_columns or cfg.d_model % cfg.num_chunks == 0,
      "num_chunks",
      cfg.num_chunks,
      f"a divisor of d_model={cfg.d_model} (schedule={self.name!r} splits the second GEMM by column blocks)",
    )
    require(
      not (self.splits_columns and cfg.weight_inputs),
      "schedule",
      self.name,
      f"one whose first GEMM waits for the weights with weight_inputs ({self.name!r} runs it on rows as they arrive, "
      "before their weights are gathered; it weights the second GEMM's output)",
    )

  def run(self, x_RxD, ids_RxZ, w_RxZ, ex: Exchange, local: Experts, num_chunks: int) -> Result:
    return self._run(x_RxD, ids_RxZ, w_RxZ, ex, local, num_chunks)


SCHEDULES = {
  s.name: s
  for s in (
    Schedule("sequential", sequential),
    Schedule("chunked", chunked, overlaps=True, splits_rows=True),
    Schedule("comet", comet, overlaps=True, splits_columns=True),
  )
}


def of(cfg) -> Schedule:
  """The schedule of `cfg.schedule`."""
  return SCHEDULES[cfg.schedule]
