"""Transports: moving token rows to the devices that hold their experts and back.

`ragged_all_to_all` and `padded_all_to_all` have the same signature and semantics (those of
`jax.lax.ragged_all_to_all`); `padded` builds them from a fixed-size `jax.lax.all_to_all` over
worst-case blocks, so it runs on every backend and is the oracle `ragged` is checked against.

`dispatch` / `combine` move rows through a sequence of hops, each a ragged exchange over one mesh
axis (or both at once): flat = [('node', 'gpu')], hierarchical = ['gpu', 'node'] (Tutel-2DH),
bilevel = ['node', 'gpu'] (SMILE: inter-node hop to the same GPU index, then intra-node).
Row buffers are sized for the worst case, so no routing can overflow them.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax import mesh as mesh_lib
from moejax import plan as plan_lib

FLAT_HOPS = ((mesh_lib.NODE, mesh_lib.GPU),)
HIERARCHICAL_HOPS = (mesh_lib.GPU, mesh_lib.NODE)  # Tutel-2DH / DeepSpeed: inside the node first
BILEVEL_HOPS = (mesh_lib.NODE, mesh_lib.GPU)  # SMILE: to the node first, then to the GPU in it


def padded_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all` semantics from a fixed-size all_to_all.

  operand: [N, ...]; output: [R, ...] (rows not received keep their value). Each peer block is
  padded to min(N, R) rows, enough for any split of the operand.
  """
  block = min(operand.shape[0], output.shape[0])
  num_peers = send_sizes.shape[0]
  i_B = jnp.arange(block)
  src_AxB = input_offsets[:, None] + i_B[None, :]
  valid_AxB = i_B[None, :] < send_sizes[:, None]
  sent = jnp.take(operand, jnp.clip(src_AxB, 0, operand.shape[0] - 1), axis=0)
  sent = jnp.where(_expand(valid_AxB, sent.ndim), sent, jnp.zeros((), operand.dtype))
  received = jax.lax.all_to_all(sent, axis_name, 0, 0)  # [A, B, ...], block s from peer s
  # Each receiver learns where its blocks go from the senders' output_offsets.
  where_AxB = jax.lax.all_to_all(output_offsets, axis_name, 0, 0)[:, None] + i_B[None, :]
  where_AxB = jnp.where(i_B[None, :] < recv_sizes[:, None], where_AxB, output.shape[0])  # out of range: dropped
  rows = received.reshape((num_peers * block,) + operand.shape[1:])
  return output.at[where_AxB.reshape(-1)].set(rows, mode="drop")


def _expand(mask, ndim):
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis_name)


EXCHANGES = {"ragged": _ragged_all_to_all, "padded": padded_all_to_all}


def exchange(operand, args: plan_lib.RaggedArgs, out_rows: int, axis_name, kind: str, fill=0):
  """One ragged exchange of `operand` [N, ...] into a fresh [out_rows, ...] buffer filled with `fill`."""
  output = jnp.full((out_rows,) + operand.shape[1:], fill, operand.dtype)
  return EXCHANGES[kind](operand, output, args.input_offsets, args.send_sizes, args.output_offsets,
                         args.recv_sizes, axis_name=axis_name)


class Route(NamedTuple):
  """What `dispatch` leaves for `combine`: one plan per hop and the row count before each hop."""

  plans: tuple[plan_lib.HopPlan, ...]
  rows_before: tuple[int, ...]


def hop_destination(expert_ids, axis_name, experts_per_gpu: int, gpus_per_node: int, num_peers: int):
  """Peer index along `axis_name` towards each row's expert; num_peers for rows with id -1."""
  device = expert_ids // experts_per_gpu
  if axis_name == mesh_lib.NODE:
    dest = device // gpus_per_node
  elif axis_name == mesh_lib.GPU:
    dest = device % gpus_per_node
  else:
    dest = device
  return jnp.where(expert_ids >= 0, dest, num_peers)


def dispatch(rows_NxD, expert_ids_N, hops, axis_sizes: dict, experts_per_gpu: int, max_rows: int, kind: str):
  """Sends each row (with its global expert id; -1 = not sent) to the device holding its expert.

  Returns (rows [R, d], expert_ids [R] with -1 on empty rows, route, sizes per hop [A, A]).
  max_rows bounds what any device can ever hold (all rows of all devices).
  """
  plans, rows_before = [], []
  for axis_name in hops:
    num_peers = _peers(axis_name, axis_sizes)
    dest = hop_destination(expert_ids_N, axis_name, experts_per_gpu, axis_sizes[mesh_lib.GPU], num_peers)
    plan = plan_lib.make_hop_plan(dest, axis_name, num_peers)
    out_rows = min(num_peers * rows_NxD.shape[0], max_rows)
    rows_before.append(rows_NxD.shape[0])
    rows_NxD = exchange(rows_NxD[plan.order], plan.forward, out_rows, axis_name, kind)
    expert_ids_N = exchange(expert_ids_N[plan.order], plan.forward, out_rows, axis_name, kind, fill=-1)
    plans.append(plan)
  return rows_NxD, expert_ids_N, Route(tuple(plans), tuple(rows_before))


def combine(rows_RxD, route: Route, hops, kind: str):
  """The reverse of `dispatch`: rows return, hop by hop, to their original positions."""
  for axis_name, plan, rows_before in reversed(list(zip(hops, route.plans, route.rows_before))):
    back = exchange(rows_RxD, plan.backward, rows_before, axis_name, kind)
    rows_RxD = jnp.zeros_like(back).at[plan.order].set(back)
  return rows_RxD


def _peers(axis_name, axis_sizes: dict) -> int:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  count = 1
  for name in names:
    count *= axis_sizes[name]
  return count


def capacity_dispatch(rows_NxD, slots_N, num_slots: int, axis_name, num_peers: int):
  """GShard/Switch dense dispatch: row i goes to slot slots_N[i] (-1 = dropped) of an [E * C] buffer.

  Slots are expert-major, so the buffer splits evenly across peers; returns the [A, E/A * C, d]
  blocks received from each peer (block s from peer s).
  """
  buffer = jnp.zeros((num_slots,) + rows_NxD.shape[1:], rows_NxD.dtype)
  buffer = buffer.at[jnp.where(slots_N >= 0, slots_N, num_slots)].set(rows_NxD, mode="drop")
  blocks = buffer.reshape((num_peers, num_slots // num_peers) + rows_NxD.shape[1:])
  return jax.lax.all_to_all(blocks, axis_name, 0, 0)


def capacity_combine(blocks, slots_N, axis_name):
  """The reverse of `capacity_dispatch`: returns [N, d], zero for dropped rows."""
  buffer = jax.lax.all_to_all(blocks, axis_name, 0, 0)
  buffer = buffer.reshape((-1,) + blocks.shape[2:])
  gathered = jnp.take(buffer, jnp.maximum(slots_N, 0), axis=0)
  return jnp.where(_expand(slots_N >= 0, gathered.ndim), gathered, jnp.zeros((), gathered.dtype))
