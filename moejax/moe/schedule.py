"""Schedules: the order in which one device's exchanges and expert compute run (Comet; SMILE A.2).

All three move the same rows along the same planned path (`transport.plan_path`) and give the same
result, drops included:
- sequential: dispatch every row, run the experts, combine.
- chunked: the rows a device sends in `num_chunks` contiguous chunks, each dispatched, computed and
  combined on its own (Tutel/FasterMoE's coarse pipeline). With the dense kind (transport='capacity')
  every chunk sends full blocks, so the padding grows with num_chunks. No chunk's exchange depends on another chunk's
  matmuls, so XLA may overlap them; the cost is num_chunks times as many, smaller, exchanges. With
  bounded buffers the drops are decided once, on the ids, by the sequential path (one more round
  trip of int32 ids), so every chunk drops exactly what sequential drops and no chunk overflows.
- comet: decomposed by the consumers' independent dimensions (Comet sec. 3.1). The last dispatch hop
  runs in two steps: my own rows (a local move) enter the first expert GEMM at once while the other
  peers' rows arrive in one exchange; hidden rows land in an expert-major buffer (rows ordered by
  (expert, source)). The second GEMM then runs one column block of d at a time for all local
  experts, and each block is combined (sent back through every hop) as soon as it is done.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import experts
from moejax.moe import plan as plan_lib
from moejax.moe import transport as transport_lib
from moejax.runtime import mesh as mesh_lib


class Exchange(NamedTuple):
  """Where rows go: the hops, the mesh's axis sizes {'node': n, 'gpu': m}, expert slots per device (an
  id's device is id // slots_per_device), the exchange kind ('ragged' | 'padded' | a `transport.Kind`)
  and the per-hop receive bound (None: the worst case, or the dense kind's blocks)."""

  hops: tuple
  axis_sizes: dict
  slots_per_device: int
  kind: object
  buffer_rows: int | None


class Experts(NamedTuple):
  """This device's experts: weights w_in/w_gate [G, d, f], w_out [G, f, d] and how to run them.
  partial_sum_over: a mesh axis whose devices hold d_ff slices of the same experts on the same rows
  (expert sharding's baseline): their partial outputs are summed over it."""

  w_in: jax.Array
  w_out: jax.Array
  w_gate: jax.Array | None
  activation: str
  backend: str
  dtype: jnp.dtype
  partial_sum_over: str | None = None

  @classmethod
  def of(cls, params: dict, cfg, partial_sum_over: str | None = None) -> "Experts":
    """A layer's local experts from its parameters (this device's shard) and config."""
    return cls(params["w_in"], params["w_out"], params.get("w_gate"), cfg.activation, cfg.expert_backend,
               jnp.dtype(cfg.dtype), partial_sum_over)

  def _sum(self, y):
    return y if self.partial_sum_over is None else jax.lax.psum(y, self.partial_sum_over)

  def ffn(self, x_RxD, group_sizes_G):
    return self._sum(experts.expert_ffn(x_RxD, group_sizes_G, self.w_in, self.w_out, self.w_gate,
                                        activation=self.activation, backend=self.backend, dtype=self.dtype))

  def hidden(self, x_RxD, group_sizes_G):
    return experts.expert_hidden(x_RxD, group_sizes_G, self.w_in, self.w_gate, activation=self.activation,
                                 backend=self.backend, dtype=self.dtype)

  def output(self, h_RxF, group_sizes_G, columns: slice):
    return self._sum(experts.expert_output(h_RxF, group_sizes_G, self.w_out[:, :, columns], backend=self.backend,
                                           dtype=self.dtype))


class Result(NamedTuple):
  """y [R, d] fp32 in the input row order (zero where not processed); arrived [R] bool: the row
  reached its expert (sent, and not dropped by a full receive buffer); the paths whose kept rows
  moved (traffic)."""

  y_RxD: jax.Array
  arrived_R: jax.Array
  paths: tuple


def local_experts(ids_R, ex: Exchange):
  """[R] local expert of each received row; slots_per_device for empty rows (sorts them last). A row
  at its device has an id in [device * G, (device + 1) * G), so the id mod G is its local expert."""
  return jnp.where(ids_R >= 0, ids_R % ex.slots_per_device, ex.slots_per_device)


def plan(ids_R, ex: Exchange):
  """The path of rows with device-level ids [R] through the exchange's hops -> (ids at arrival, path)."""
  devices = ex.axis_sizes[mesh_lib.NODE] * ex.axis_sizes[mesh_lib.GPU]
  return transport_lib.plan_path(ids_R, ex.hops, ex.axis_sizes, ex.slots_per_device,
                                  max_rows=devices * ids_R.shape[0], kind=ex.kind, buffer_rows=ex.buffer_rows)


def _expert_major(key_R, groups: int):
  """(order [R] sorting the rows by (key, row), position [R] of each row once sorted (order's inverse), group
  sizes [groups]); key == groups: empty."""
  order = jnp.argsort(key_R, stable=True)
  return order, plan_lib.inverse_permutation(order), plan_lib.histogram(key_R, groups)


def run_grouped(rows_RxD, key_R, groups: int, ffn):
  """ffn on rows in any order, each with its group key in [0, groups] (groups = empty row): rows sorted
  by group, ffn(rows, group_sizes [groups]) -> [R, d'], back in the input order, 0 on empty rows."""
  order, position, group_sizes = _expert_major(key_R, groups)
  y_RxD = ffn(plan_lib.permute_rows(rows_RxD, order, position), group_sizes)
  return jnp.where((key_R < groups)[:, None], plan_lib.permute_rows(y_RxD, position, order), 0.0)


def run_experts(rows_RxD, ids_R, ex: Exchange, local: Experts):
  """The local experts on received rows in any order (id -1 = empty row) -> [R, d] fp32, 0 on empty rows."""
  return run_grouped(rows_RxD, local_experts(ids_R, ex), ex.slots_per_device, local.ffn)


def _may_drop(ex: Exchange) -> bool:
  """Whether a hop may drop rows: a bounded receive buffer, or the dense kind's blocks (the exchange sends a peer
  no more than a block, however the layer sized it)."""
  return ex.buffer_rows is not None or transport_lib.as_kind(ex.kind).block_rows is not None


def _send_back(y_RxD, ids_out, ids_R, path, ex: Exchange):
  """The experts' rows back to their senders -> (y [R, d], arrived [R]). Where a hop may drop rows, y goes with
  one more column, 1 on the rows an expert processed, so the combine also brings back which rows arrived without
  an exchange of its own; where none may, every row sent arrives and y keeps its width (d, not an unaligned d + 1)."""
  if not _may_drop(ex):
    return transport_lib.move_back(y_RxD, path, ex.hops, ex.kind), ids_R >= 0
  marked_RxD = jnp.concatenate([y_RxD, (ids_out >= 0).astype(y_RxD.dtype)[:, None]], axis=1)
  back_RxD = transport_lib.move_back(marked_RxD, path, ex.hops, ex.kind)
  return back_RxD[:, :-1], back_RxD[:, -1] > 0


def _round_trip(x_RxD, ids_R, ex: Exchange, local: Experts):
  """Dispatch, experts, combine -> (y [R, d], arrived [R], path)."""
  ids_out, path = plan(ids_R, ex)
  rows_RxD = transport_lib.move_through(x_RxD, path, ex.hops, ex.kind)
  y_RxD, arrived_R = _send_back(run_experts(rows_RxD, ids_out, ex, local), ids_out, ids_R, path, ex)
  return y_RxD, arrived_R, path


def sequential(x_RxD, ids_R, ex: Exchange, local: Experts, num_chunks: int = 1) -> Result:
  """Dispatch, experts, combine. x [R, d]; ids [R] device-level expert ids (-1 = not sent)."""
  del num_chunks
  y_RxD, arrived_R, path = _round_trip(x_RxD, ids_R, ex, local)
  return Result(y_RxD, arrived_R, (path,))


def chunked(x_RxD, ids_R, ex: Exchange, local: Experts, num_chunks: int) -> Result:
  """`sequential` on num_chunks contiguous chunks of rows; with bounded buffers the drops are decided
  once by the sequential path, so no chunk overflows."""
  if ex.buffer_rows is not None:  # a chunk's rows fit wherever all of the kept rows fit
    ids_out, path = plan(ids_R, ex)
    ids_R = jnp.where(transport_lib.arrived(ids_out, path, ex.hops, ex.kind), ids_R, -1)
  parts = [_round_trip(x, ids, ex, local) for x, ids in
           zip(jnp.split(x_RxD, num_chunks), jnp.split(ids_R, num_chunks))]
  return Result(jnp.concatenate([y for y, _, _ in parts]), jnp.concatenate([a for _, a, _ in parts]),
                tuple(path for _, _, path in parts))


def comet(x_RxD, ids_R, ex: Exchange, local: Experts, num_chunks: int) -> Result:
  """Comet's decomposition; num_chunks column blocks of d in the second GEMM and the combine."""
  ids_out, path = plan(ids_R, ex)
  axis, last, out_rows = ex.hops[-1], path.plans[-1], path.out_rows[-1]
  num_peers = last.sizes_AxA.shape[0]
  me = jax.lax.axis_index(axis)
  # Earlier hops move whole; the last one, which feeds the GEMM, in two steps.
  rows_RxD = plan_lib.permute_rows(transport_lib.move_through(x_RxD, path, ex.hops[:-1], ex.kind), last.order,
                                   last.inverse)
  groups = ex.slots_per_device
  key_R = local_experts(ids_out, ex)
  order_R, position_R, group_sizes = _expert_major(key_R, groups)
  recv_offsets, recv_sizes = last.backward.input_offsets, last.forward.recv_sizes
  # My own rows first (a local move: they enter the first GEMM at once) while the others arrive in one
  # exchange. Two steps, not one per peer: their buffers (my rows, and the receive buffer) do not grow
  # with the peer count, where a block per peer alive at once would.
  own_forward, own_backward = plan_lib.shift_args(last.forward, last.backward, 0, me)
  own = min(rows_RxD.shape[0], out_rows)
  i_J = jnp.arange(own)
  q_J = jnp.minimum(recv_offsets[me] + i_J, out_rows - 1)  # the rows' places in the receive layout
  steps = [(transport_lib.move_rows(rows_RxD, own_forward, own_backward, own, axis, ex.kind, (0,)), q_J,
            jnp.where(i_J < recv_sizes[me], key_R[q_J], groups))]
  if num_peers > 1:
    forward, backward = plan_lib.without_self(last.forward, last.backward, me)
    q_R = jnp.arange(out_rows)
    mine = (q_R >= recv_offsets[me]) & (q_R < recv_offsets[me] + recv_sizes[me])
    steps.append((transport_lib.move_rows(rows_RxD, forward, backward, out_rows, axis, ex.kind,
                                          tuple(range(1, num_peers))), q_R, jnp.where(mine, groups, key_R)))
  h_RxF = None
  for x_JxD, q_J, key_J in steps:
    step_order, step_position, step_sizes = _expert_major(key_J, groups)
    h_JxF = local.hidden(plan_lib.permute_rows(x_JxD, step_order, step_position), step_sizes)
    h_JxF = plan_lib.permute_rows(h_JxF, step_position, step_order)
    if h_RxF is None:
      h_RxF = jnp.zeros((out_rows, h_JxF.shape[1]), h_JxF.dtype)
    h_RxF = h_RxF.at[jnp.where(key_J < groups, position_R[q_J], out_rows)].set(h_JxF, mode="drop")
  width = x_RxD.shape[1] // num_chunks
  blocks = []
  for j in range(num_chunks):
    y_block = plan_lib.permute_rows(local.output(h_RxF, group_sizes, slice(j * width, (j + 1) * width)), position_R,
                                    order_R)
    y_block = jnp.where((ids_out >= 0)[:, None], y_block, 0.0)
    if j == 0:  # the first block brings back which rows arrived
      y_block, arrived_R = _send_back(y_block, ids_out, ids_R, path, ex)
    else:
      y_block = transport_lib.move_back(y_block, path, ex.hops, ex.kind)
    blocks.append(y_block)
  return Result(jnp.concatenate(blocks, axis=1), arrived_R, (path,))


SCHEDULES = {"sequential": sequential, "chunked": chunked, "comet": comet}


def run(schedule: str, x_RxD, ids_R, ex: Exchange, local: Experts, num_chunks: int) -> Result:
  return SCHEDULES[schedule](x_RxD, ids_R, ex, local, num_chunks)
