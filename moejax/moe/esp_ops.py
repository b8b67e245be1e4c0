"""Parm's operations on the MP group (a node's GPUs, axis 'gpu') that expert sharding's schedules use
(`moe.expert_sharding`): the MP split whose backward is an all-gather (Parm Sec. III-B), the MP and ESP
all-gathers (invariant gathers whose backward is a local slice), and S2's dispatched tensor."""

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from moejax.moe import routing
from moejax.runtime.mesh import GPU

if TYPE_CHECKING:  # config imports the expert shardings, which import this module
  from moejax.moe.config import MoEConfig


@jax.custom_vjp
def mp_split(x):
  """MP-Split: this GPU's chunk of the rows of an array replicated over 'gpu' (no communication).

  The backward all-gathers the chunks' cotangents over 'gpu' (Parm: a split costs an AllGather in
  backpropagation), instead of the all-reduce of zero-padded cotangents that indexing by axis_index
  transposes to.
  """
  return my_chunk(x)


def my_chunk(x):
  """This GPU's chunk of the rows of x (no gradient rule of its own: integer arrays, mp_split's forward)."""
  chunk = x.shape[0] // jax.lax.axis_size(GPU)
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(GPU) * chunk, chunk, 0)


def _mp_split_fwd(x):
  return mp_split(x), None


def _mp_split_bwd(_, grad):
  return (jax.lax.all_gather(grad, GPU, axis=0, tiled=True, to="invarying"),)


mp_split.defvjp(_mp_split_fwd, _mp_split_bwd)


def mp_all_gather(x):
  """MP-AllGather: the m GPUs' chunks concatenated along the rows, replicated over 'gpu' (its backward
  is a local slice)."""
  return jax.lax.all_gather(x, GPU, axis=0, tiled=True, to="invarying")


def esp_all_gather(x):
  """The baseline's ESP-AllGather: the m copies of the node's tokens (identical: x is replicated)."""
  return jax.lax.all_gather(x, GPU, axis=0, tiled=True, to="invarying")


def dispatched_tensor(x_RxD, ids_R, w_R, expert_ids_TxK, keep_TxK, rows: int, cfg: "MoEConfig"):
  """S2's dispatched tensor, which it splits over the node's GPUs: with capacity GShard's slot buffer
  [E, C', d] (a choice in its expert's row at its queue position), split on the capacity axis as Parm
  does, so each GPU sends at most C' / m rows per expert, dropless the token-choice rows padded to `rows`.
  x [R, d], ids [R] and weights [R] in token-choice order -> (rows [rows, d], ids [rows] (-1 = empty),
  weights [rows] (0 = empty), slot [R]: where each choice sits, -1 if dropped)."""
  num_choices = ids_R.shape[0]
  if cfg.capacity_factor is None:
    pad = rows - num_choices
    return (
      jnp.pad(x_RxD, ((0, pad), (0, 0))),
      jnp.pad(ids_R, (0, pad), constant_values=-1),
      jnp.pad(w_R, (0, pad)),
      jnp.arange(num_choices),
    )
  block = rows // (cfg.num_experts * jax.lax.axis_size(GPU))  # C' / m: an expert's slots on one GPU
  positions_TxK = routing.queue_positions(expert_ids_TxK, cfg.num_experts)
  # Laid out [m, E, C' / m]: GPU j's contiguous share holds capacity block j of every expert.
  slot_TxK = (positions_TxK // block * cfg.num_experts + expert_ids_TxK) * block + positions_TxK % block
  slot_R = jnp.where(keep_TxK, slot_TxK, -1).reshape(-1)
  where_R = jnp.where(slot_R >= 0, slot_R, rows)
  place = lambda a, fill: jnp.full((rows,) + a.shape[1:], fill, a.dtype).at[where_R].set(a, mode="drop")
  return place(x_RxD, 0), place(ids_R, -1), place(w_R, 0), slot_R


def undispatch(y_ZxD, slot_R):
  """The rows of the dispatched tensor [Z, d] (Z slots) back in token-choice order [R, d] (0 where dropped)."""
  rows = jnp.take(y_ZxD, jnp.maximum(slot_R, 0), axis=0)
  return jnp.where((slot_R >= 0)[:, None], rows, jnp.zeros((), rows.dtype))


def s2_capacity(cfg: "MoEConfig", tokens: int, gpus_per_node: int) -> int:
  """S2's capacity C padded to a multiple of m, so that the slot buffer [E, C'] splits evenly over the
  node's GPUs (padding slots stay empty)."""
  capacity = routing.expert_capacity(cfg, tokens)
  return -(-capacity // gpus_per_node) * gpus_per_node
