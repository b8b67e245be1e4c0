"""Dispatch plans: pure index math that turns per-row destinations into ragged exchange arguments.

One exchange ("hop") runs over one mesh axis, or over both axes as one, with A peers. Each device
sorts its rows by destination peer; `sizes_AxA[s, p]` is the number of rows peer s wants to send to
peer p. The receiver lays out what it gets source by source (the layout of
`jax.lax.ragged_all_to_all`) in a buffer of a fixed number of rows; what does not fit is clamped
deterministically, lower sources first (`clamp_to_buffer`), so `kept_AxA[s, p]` rows really move and
each block's tail rows are dropped. Only `make_hop_plan` communicates (one all_gather of A int32
sizes); everything else is local.
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
  """order: [R] permutation sorting my rows by destination (rows to no peer last); inverse: [R] its inverse;
  sizes_AxA: [A, A] rows each source wants to send to each destination along the hop's axis;
  kept_AxA: [A, A] the rows that fit the receivers' buffers (what moves);
  sent_R: [R] bool, in my original row order: the row was sent (has a destination and fitted);
  forward / backward: the ragged all-to-all arguments of dispatch and of the reverse (combine)."""

  order: jax.Array
  inverse: jax.Array
  sizes_AxA: jax.Array
  kept_AxA: jax.Array
  sent_R: jax.Array
  forward: RaggedArgs
  backward: RaggedArgs


def exclusive_cumsum(v: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(v, axis=axis) - v


def histogram(ids: jax.Array, size: int) -> jax.Array:
  """[size] int32 occurrences of each id in [0, size); ids outside (e.g. -1) are not counted."""
  ids = ids.reshape(-1)
  return jnp.zeros(size + 1, jnp.int32).at[jnp.where((ids >= 0) & (ids < size), ids, size)].add(1)[:size]


def inverse_permutation(order_R: jax.Array) -> jax.Array:
  """[R]: the place of each row once sorted by the permutation `order` (order[inverse[i]] == i)."""
  return jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))


@jax.custom_vjp
def permute_rows(x_RxD: jax.Array, order_R: jax.Array, inverse_R: jax.Array) -> jax.Array:
  """x[order] for a permutation `order` of x's rows with its inverse. The backward is the gather
  g[inverse] (a permutation's transpose is its inverse) where autodiff's would scatter-add into zeros."""
  return x_RxD[order_R]


def _permute_rows_fwd(x_RxD, order_R, inverse_R):
  return x_RxD[order_R], inverse_R


def _permute_rows_bwd(inverse_R, grad_RxD):
  return grad_RxD[inverse_R], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def rank_in_group(key_R: jax.Array, num_groups: int) -> jax.Array:
  """[R] int32: how many earlier rows share each row's key (keys in [0, num_groups]), by one stable sort."""
  order = jnp.argsort(key_R, stable=True)
  first = exclusive_cumsum(histogram(key_R, num_groups + 1))  # where each key's rows start once sorted
  rank_sorted = jnp.arange(key_R.shape[0], dtype=jnp.int32) - first[key_R[order]]
  return jnp.zeros(key_R.shape[0], jnp.int32).at[order].set(rank_sorted)


def sort_by_destination(dest_R: jax.Array, num_peers: int) -> tuple[jax.Array, jax.Array]:
  """(order [R], send_sizes [A]); dest == num_peers marks a row that is sent nowhere."""
  order = jnp.argsort(dest_R, stable=True).astype(jnp.int32)
  return order, histogram(dest_R, num_peers)


def clamp_to_buffer(sizes_AxA: jax.Array, buffer_rows: int) -> jax.Array:
  """[A, A] rows that fit receivers holding `buffer_rows` rows each: per receiver, the sources'
  sizes cumulated in source order, clamped to the buffer, then differenced (lower sources first)."""
  fitted = jnp.minimum(jnp.cumsum(sizes_AxA, axis=0), buffer_rows)
  return jnp.diff(fitted, axis=0, prepend=jnp.zeros_like(fitted[:1]))


def ragged_args(
  sizes_AxA: jax.Array, me: jax.Array, kept_AxA: jax.Array | None = None
) -> tuple[RaggedArgs, RaggedArgs]:
  """Forward and backward ragged all-to-all arguments of device `me`: blocks start where the full
  size matrix puts them in the sender's sorted rows, and the first kept_AxA rows of each move
  (kept_AxA defaults to everything)."""
  kept_AxA = sizes_AxA if kept_AxA is None else kept_AxA
  send = kept_AxA[me]
  recv = kept_AxA[:, me]
  input_offsets = exclusive_cumsum(sizes_AxA[me])
  recv_offsets = exclusive_cumsum(recv)
  # My block in peer p's output starts after the blocks of all sources before me.
  output_offsets = exclusive_cumsum(kept_AxA, axis=0)[me]
  # Reverse: what peer p sent me goes back to where it came from in p's sorted operand.
  return_offsets = exclusive_cumsum(sizes_AxA, axis=1)[:, me]
  return (RaggedArgs(input_offsets, send, output_offsets, recv), RaggedArgs(recv_offsets, recv, return_offsets, send))


def shift_args(forward: RaggedArgs, backward: RaggedArgs, shift: int, me: jax.Array) -> tuple[RaggedArgs, RaggedArgs]:
  """One ring step of an exchange: I send only my block for peer me + shift and receive only the block
  of peer me - shift, into a buffer of its own (offset 0). Returns that step's forward arguments and
  their reverse (the block goes back to where it came from in the sender's operand)."""
  num_peers = forward.send_sizes.shape[0]
  peer = jnp.arange(num_peers)
  to_dest = peer == (me + shift) % num_peers
  from_src = peer == (me - shift) % num_peers
  sent = jnp.where(to_dest, forward.send_sizes, 0)
  received = jnp.where(from_src, forward.recv_sizes, 0)
  zeros = jnp.zeros_like(forward.output_offsets)
  return (
    RaggedArgs(forward.input_offsets, sent, zeros, received),
    RaggedArgs(zeros, received, jnp.where(from_src, backward.output_offsets, 0), sent),
  )


def without_self(forward: RaggedArgs, backward: RaggedArgs, me: jax.Array) -> tuple[RaggedArgs, RaggedArgs]:
  """The exchange with my block to myself left out (every offset unchanged): forward and reverse."""
  other = jnp.arange(forward.send_sizes.shape[0]) != me
  mask = lambda args: args._replace(
    send_sizes=jnp.where(other, args.send_sizes, 0), recv_sizes=jnp.where(other, args.recv_sizes, 0)
  )
  return mask(forward), mask(backward)


def make_hop_plan(
  dest_R: jax.Array, axis_name, num_peers: int, buffer_rows: int, block_rows: int | None = None
) -> HopPlan:
  """Plan for one hop inside `shard_map`; dest_R in [0, A], A = not sent; receivers hold
  `buffer_rows` rows; with `block_rows` (a dense exchange) each source sends each peer at most that."""
  order, send_sizes = sort_by_destination(dest_R, num_peers)
  sizes_AxA = jax.lax.all_gather(send_sizes, axis_name)
  me = jax.lax.axis_index(axis_name)
  kept_AxA = clamp_to_buffer(sizes_AxA if block_rows is None else jnp.minimum(sizes_AxA, block_rows), buffer_rows)
  forward, backward = ragged_args(sizes_AxA, me, kept_AxA)
  # Sorted row i goes to peer dest[order[i]] at position i - block start; it moves if within kept.
  dest_sorted = dest_R[order]
  peer = jnp.minimum(dest_sorted, num_peers - 1)
  position = jnp.arange(dest_R.shape[0]) - forward.input_offsets[peer]
  sent_sorted = (dest_sorted < num_peers) & (position < forward.send_sizes[peer])
  inverse = inverse_permutation(order)
  return HopPlan(order, inverse, sizes_AxA, kept_AxA, sent_sorted[inverse], forward, backward)
