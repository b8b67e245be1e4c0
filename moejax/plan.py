"""Dispatch plans: pure index math that turns per-row destinations into ragged exchange arguments.

One exchange ("hop") runs over one mesh axis, or over both axes as one, with A peers. Each device
sorts its rows by destination peer; `sizes_AxA[s, p]` is the number of rows peer s sends to peer p.
The receiver lays out what it gets source by source (the layout of `jax.lax.ragged_all_to_all`).
Only `make_hop_plan` communicates (one all_gather of A int32 sizes); everything else is local.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RaggedArgs(NamedTuple):
  """The offsets/sizes arguments of one ragged all-to-all, as seen by one device (each [A] int32)."""

  input_offsets: jax.Array  # where my block for peer p starts in my operand
  send_sizes: jax.Array  # rows I send to peer p
  output_offsets: jax.Array  # where my block starts in peer p's output
  recv_sizes: jax.Array  # rows I receive from peer p


class HopPlan(NamedTuple):
  """order: [N] permutation sorting my rows by destination (rows to no peer last);
  sizes_AxA: [A, A] rows from each source to each destination along the hop's axis;
  forward / backward: the ragged all-to-all arguments of dispatch and of the reverse (combine)."""

  order: jax.Array
  sizes_AxA: jax.Array
  forward: RaggedArgs
  backward: RaggedArgs


def exclusive_cumsum(v: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(v, axis=axis) - v


def sort_by_destination(dest_N: jax.Array, num_peers: int) -> tuple[jax.Array, jax.Array]:
  """(order [N], send_sizes [A]); dest == num_peers marks a row that is sent nowhere."""
  order = jnp.argsort(dest_N, stable=True).astype(jnp.int32)
  send_sizes = jnp.zeros(num_peers + 1, jnp.int32).at[dest_N].add(1)[:num_peers]
  return order, send_sizes


def ragged_args(sizes_AxA: jax.Array, me: jax.Array) -> tuple[RaggedArgs, RaggedArgs]:
  """Forward and backward ragged all-to-all arguments of device `me` from the full size matrix."""
  send = sizes_AxA[me]
  recv = sizes_AxA[:, me]
  input_offsets = exclusive_cumsum(send)
  recv_offsets = exclusive_cumsum(recv)
  # My block in peer p's output starts after the blocks of all sources before me.
  output_offsets = exclusive_cumsum(sizes_AxA, axis=0)[me]
  # Reverse: what peer p sent me goes back to where it came from in p's sorted operand.
  return_offsets = exclusive_cumsum(sizes_AxA, axis=1)[:, me]
  return (RaggedArgs(input_offsets, send, output_offsets, recv),
          RaggedArgs(recv_offsets, recv, return_offsets, send))


def make_hop_plan(dest_N: jax.Array, axis_name, num_peers: int) -> HopPlan:
  """Plan for one hop inside `shard_map`; dest_N in [0, A], A = not sent."""
  order, send_sizes = sort_by_destination(dest_N, num_peers)
  sizes_AxA = jax.lax.all_gather(send_sizes, axis_name)
  forward, backward = ragged_args(sizes_AxA, jax.lax.axis_index(axis_name))
  return HopPlan(order, sizes_AxA, forward, backward)
