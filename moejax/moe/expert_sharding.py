"""Expert sharding (Parm): experts over 'node' (EP), each expert's d_ff over 'gpu' (ESP = MP).

Parm (arXiv 2407.00599; digest Sec. 2-5, 10) in the special case ESP = MP of DeepSpeed-TED. The layer
input x [tokens, d] is sharded over 'node' and replicated over the m GPUs of a node (the MP group, as
Megatron tensor parallelism of the dense parts leaves it); y comes back the same way. Expert e lives on
node e // (E / n); GPU j of that node holds hidden slice j of width f / m (columns of w_in / w_gate, rows
of w_out), so an expert's output is the sum of its m slices' partial outputs (the activation is
elementwise in f). Expert sharding is not a second layer: it decides which tokens or rows a GPU routes
and sends, and where a choice's m partial outputs are summed; routing, capacity, the exchange, the
schedules and the combine are the layer's own (`moe.layer`). Per schedule (BLM = the node's tokens,
ETM = its dispatched rows):

  baseline (DeepSpeed-MoE, Parm Sec. IV-A): ESP all-gather of x (BLM x N_ESP: every token computed N_MP
    times), the rows sent over 'node' to the same GPU index of the expert's node, the slice partials
    summed by an ESP all-reduce, the copy of this GPU's own tokens kept.
  s1 (PauseMP before the gate): MP split of the tokens (each GPU routes T / m), the Dump (each row to
    all m GPUs of its expert's node, one exchange over both axes), partials summed on return, MP
    all-gather of y (BLM).
  s2 (PauseMP after the gate): the node's tokens routed on every GPU, MP split of the dispatched rows,
    the Dump, partials summed on return, MP all-gather of the expert outputs (ETM), gate combine.

`mp_split` is a split whose backward is an MP all-gather (Parm Sec. III-B); the MP all-gathers are
invariant gathers whose backward is a local slice.

Capacity: each schedule gates a different group of tokens, so its capacity and drops differ (Parm does
not discuss this): baseline and s2 gate the node's tokens (`reference.moe_reference(num_groups=n)`),
s1 each GPU's (`num_groups=n * m`).
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from moejax.cost import parm
from moejax.cost import topology as topology_lib
from moejax.moe.config import MoEConfig
from moejax.moe.routing import queue_positions
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError

NODE, GPU = mesh_lib.NODE, mesh_lib.GPU


def resolve_auto(cfg: MoEConfig, tokens: int, nodes: int, gpus_per_node: int) -> MoEConfig:
  """cfg with esp_schedule='auto' replaced by the schedule Parm's Algorithm 1 picks
  (`moejax.cost.parm.choose_schedule`) for `tokens` global tokens per layer call: EP = n nodes,
  ESP = MP = m GPUs, B x L = a node's tokens, alpha-beta terms from cfg.esp_cost. Call it when the
  config is made (the trainer does): the layer refuses 'auto'. Other configs come back unchanged."""
  if cfg.esp_schedule != "auto":
    return cfg
  n, m = nodes, gpus_per_node
  bytes_per_element = jnp.dtype(cfg.dtype).itemsize
  if os.path.exists(cfg.esp_cost):
    with open(cfg.esp_cost) as f:
      terms = parm.alpha_beta_from_bench(json.load(f), bytes_per_element)
  else:
    try:
      preset = topology_lib.get(cfg.esp_cost)
    except ValueError as e:  # names the known presets
      raise ConfigError(f"esp_cost={cfg.esp_cost!r} is neither a file nor a topology preset: {e}", "esp_cost",
                        cfg.esp_cost) from e
    terms = parm.alpha_beta_from_topology(preset, n, m, m, bytes_per_element)
  layer_shape = parm.ParmLayer(B=max(tokens // n, 1), L=1, M=cfg.d_model, H=cfg.d_ff, E=cfg.num_experts,
                               k=cfg.choices_per_token, f=cfg.capacity_factor or 1.0, n_ep=n, n_esp=m, n_mp=m)
  return dataclasses.replace(cfg, esp_schedule=parm.choose_schedule(layer_shape, terms))


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


def dispatched_tensor(x_RxD, ids_R, expert_ids_TxK, keep_TxK, rows: int, cfg: MoEConfig):
  """S2's dispatched tensor, which it splits over the node's GPUs: with capacity GShard's slot buffer
  [E, C', d] (a choice in its expert's row at its queue position), split on the capacity axis as Parm
  does, so each GPU sends at most C' / m rows per expert, dropless the token-choice rows padded to `rows`.
  x [R, d] and ids [R] in token-choice order -> (rows [rows, d], ids [rows] (-1 = empty), slot [R]:
  where each choice sits, -1 if dropped)."""
  num_choices = ids_R.shape[0]
  if cfg.capacity_factor is None:
    pad = rows - num_choices
    return jnp.pad(x_RxD, ((0, pad), (0, 0))), jnp.pad(ids_R, (0, pad), constant_values=-1), jnp.arange(num_choices)
  block = rows // (cfg.num_experts * jax.lax.axis_size(GPU))  # C' / m: an expert's slots on one GPU
  positions_TxK = queue_positions(expert_ids_TxK, cfg.num_experts)
  # Laid out [m, E, C' / m]: GPU j's contiguous share holds capacity block j of every expert.
  slot_TxK = (positions_TxK // block * cfg.num_experts + expert_ids_TxK) * block + positions_TxK % block
  slot_R = jnp.where(keep_TxK, slot_TxK, -1).reshape(-1)
  where_R = jnp.where(slot_R >= 0, slot_R, rows)
  buffer = jnp.zeros((rows, x_RxD.shape[1]), x_RxD.dtype).at[where_R].set(x_RxD, mode="drop")
  return buffer, jnp.full((rows,), -1, ids_R.dtype).at[where_R].set(ids_R, mode="drop"), slot_R


def undispatch(y_ZxD, slot_R):
  """The rows of the dispatched tensor [Z, d] (Z slots) back in token-choice order [R, d] (0 where dropped)."""
  rows = jnp.take(y_ZxD, jnp.maximum(slot_R, 0), axis=0)
  return jnp.where((slot_R >= 0)[:, None], rows, jnp.zeros((), rows.dtype))


def dump(holder_ids_R, slots_per_node: int, gpus_per_node: int, schedule: str):
  """Rows to devices: each row (its node-level slot id h, -1 = not sent) becomes `copies` rows whose
  device-level ids (device * slots_per_node + h % slots_per_node) name the GPUs holding the slot's d_ff
  slices: all m GPUs of its node (s1, s2: Parm's Dump), or one (baseline, which sums the partials with
  an all-reduce instead): its exchange runs over 'node' alone, which keeps the sender's GPU index, so
  the id names GPU 0 of the node (and stays the same on every GPU of the sender's node, as the
  all-reduce needs). Returns (ids [R * copies], copies)."""
  node, local = holder_ids_R // slots_per_node, holder_ids_R % slots_per_node
  if schedule == "baseline":
    return jnp.where(holder_ids_R >= 0, node * gpus_per_node * slots_per_node + local, -1), 1
  device = node[:, None] * gpus_per_node + jnp.arange(gpus_per_node)[None, :]
  ids = jnp.where((holder_ids_R >= 0)[:, None], device * slots_per_node + local[:, None], -1)
  return ids.reshape(-1), gpus_per_node
