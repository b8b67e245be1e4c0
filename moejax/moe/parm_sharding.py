"""Parm's expert sharding: experts over 'node' (EP), each expert's d_ff over 'gpu' (ESP = MP).

Parm (arXiv 2407.00599, Sec. III-IV) in the special case ESP = MP of DeepSpeed-TED. The layer
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

The three schedules override the interface (`moe.expert_parallel.ExpertParallel`); `auto` (Parm's Algorithm 1)
is resolved to one of them when the config is made. The MP-group operations they use are in `moe.esp_ops`.

Capacity: each schedule gates a different group of tokens, so its capacity and drops differ (Parm does
not discuss this): baseline and s2 gate the node's tokens (`reference.moe_reference(dispatch_groups=n)`),
s1 each GPU's (`dispatch_groups=n * m`).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe import esp_ops
from moejax.moe.expert_parallel import ExpertParallel, Sent
from moejax.runtime.mesh import AXES, GPU, NODE
from moejax.validation import ConfigError, require


class _Sharded(ExpertParallel):
  """Parm's expert sharding: experts over 'node', each expert's d_ff over the node's GPUs (x replicated over
  'gpu'); the Dump sends each row to the GPUs holding its slot's d_ff slices."""

  splits_d_ff = True
  holder_unit = "nodes"
  x_axes = routed_over = (NODE,)
  shared_sum_over = GPU
  needs_vma = True
  expert_specs = {
    "w_in": P(NODE, None, GPU),
    "w_out": P(NODE, GPU, None),
    "w_gate": P(NODE, None, GPU),
    "b_in": P(NODE, GPU),
    "b_out": P(NODE),
    "b_gate": P(NODE, GPU),
  }
  shared_specs = {"w_in": P(None, GPU), "w_out": P(GPU, None), "w_gate": P(None, GPU)}
  where = "tokens sharded over the nodes"

  def out_bias(self, b_out_GxD):
    """b_out added once per expert: by the GPU holding d_ff slice 0 (the partial outputs are summed over 'gpu')."""
    return jnp.where(jax.lax.axis_index(GPU) == 0, b_out_GxD, jnp.zeros((), b_out_GxD.dtype))

  def holders(self, n, m):
    return n

  def holders_are(self, n, m):
    return f"{n} nodes (expert sharding puts E / n whole experts on each node)"

  def token_groups(self, n, m):
    return n

  def check_tokens(self, tokens, n, m):
    if tokens % self.token_groups(n, m):
      raise ConfigError(
        f"x has {tokens} tokens, not a multiple of {self.token_groups(n, m)} (esp_schedule={self.name!r}: {self.where})"
      )

  def holder_index(self, m):
    return jax.lax.axis_index(NODE)

  def copies(self, m):
    return m

  def dump(self, holder_ids_RxK, slots, m):  # Parm's Dump: to all m GPUs of the slot's node
    node, local = holder_ids_RxK // slots, holder_ids_RxK % slots
    device = node[..., None] * m + jnp.arange(m)
    ids = jnp.where((holder_ids_RxK >= 0)[..., None], device * slots + local[..., None], -1)
    return ids.reshape(holder_ids_RxK.shape[0], -1)


class Baseline(_Sharded):
  """DeepSpeed-MoE: the ESP all-gather (all m identical copies of the node's tokens sent), one hop over 'node',
  the slices' partial outputs summed over 'gpu' by the experts, the copy of this GPU's own tokens kept."""

  name = "baseline"
  sent_over = (NODE,)
  partial_sum_over = GPU

  def send_rows(self, cfg, routed_tokens, m):
    return m * routed_tokens * cfg.choices_per_token

  def gathered(self, m):
    return m

  def hops(self, cfg):
    require(
      len(super().hops(cfg)) == 1,
      "path",
      cfg.path,
      "'flat' with esp_schedule='baseline': its exchange runs over 'node' alone (each GPU to the same GPU "
      "index of the expert's node, whose ESP all-reduce needs every GPU of a node to hold the same rows), so "
      "there is no intra-node hop for a two-hop path to take",
    )
    return (NODE,)

  def rows_to_send(self, x_TxD, expert_ids_TxK, keep_TxK, w_TxK, rows, m, cfg):
    sent = super().rows_to_send(x_TxD, expert_ids_TxK, keep_TxK, w_TxK, rows, m, cfg)
    return Sent(esp_ops.esp_all_gather(x_TxD), jnp.tile(sent.ids_RxK, (m, 1)), jnp.tile(sent.w_RxK, (m, 1)))

  def copies(self, m):
    return 1

  def dump(self, holder_ids_RxK, slots, m):
    """To one GPU: the exchange runs over 'node' alone, which keeps the sender's GPU index, so the id names GPU
    0 of the node (and stays the same on every GPU of the sender's node, as the all-reduce needs)."""
    node, local = holder_ids_RxK // slots, holder_ids_RxK % slots
    return jnp.where(holder_ids_RxK >= 0, node * m * slots + local, -1)

  def own_rows(self, m, *arrays_R):  # all m copies of the node's tokens are equal; this GPU's is the first
    return tuple(a[: a.shape[0] // m] for a in arrays_R)


class S1(_Sharded):
  """PauseMP before the gate: each GPU routes its share of the node's tokens, the Dump sends each row to all m
  GPUs of its expert's node, partials summed on return, the layer output all-gathered over 'gpu'."""

  name = "s1"
  routed_over = AXES
  where = "each node's tokens split over its GPUs"

  def token_groups(self, n, m):
    return n * m

  def split_tokens(self, x_TxD):
    return esp_ops.mp_split(x_TxD)

  def gather_tokens(self, a_TxX):
    return esp_ops.mp_all_gather(a_TxX)


class S2(_Sharded):
  """PauseMP after the gate: the node's tokens routed on every GPU, each GPU sending its share of the
  dispatched tensor through the Dump, the expert outputs all-gathered over 'gpu' before the gate combine."""

  name = "s2"
  dedups_by_default = False  # its dispatched tensor holds a row per token-choice

  def check(self, cfg):
    require(
      not cfg.dedup,
      "dedup",
      cfg.dedup,
      f"False or None with esp_schedule={self.name!r}: its dispatched tensor [E, C', d] holds one row per "
      "token-choice, which S2 splits over the node's GPUs, so a row per token and destination has no place in it",
    )

  def send_rows(self, cfg, routed_tokens, m):
    if cfg.capacity_factor is not None:  # the slot buffer [E, C'] split on its capacity axis
      return cfg.num_experts * esp_ops.s2_capacity(cfg, routed_tokens, m) // m
    return -(-routed_tokens * cfg.choices_per_token // m)

  def dense_rows_per_slot(self, cfg, routed_tokens, m):
    return esp_ops.s2_capacity(cfg, routed_tokens, m) // m

  def rows_to_send(self, x_TxD, expert_ids_TxK, keep_TxK, w_TxK, rows, m, cfg):
    """Token-choice rows (one choice each) in the dispatched tensor, this GPU's share of it."""
    sent = super().rows_to_send(x_TxD, expert_ids_TxK, keep_TxK, w_TxK, rows, m, cfg)
    x_RxD = jnp.repeat(x_TxD, cfg.choices_per_token, axis=0)
    x_ZxD, ids_Z, w_Z, slot_R = esp_ops.dispatched_tensor(
      x_RxD, sent.ids_RxK.reshape(-1), sent.w_RxK.reshape(-1), expert_ids_TxK, keep_TxK, rows * m, cfg
    )
    return Sent(esp_ops.mp_split(x_ZxD), esp_ops.my_chunk(ids_Z)[:, None], esp_ops.mp_split(w_Z)[:, None], slot_R)

  def finish(self, y_RxD, sent, dtype):  # every GPU's outputs of the dispatched tensor, in token-choice order
    return esp_ops.undispatch(esp_ops.mp_all_gather(y_RxD.astype(dtype)), sent.state)


class Auto(_Sharded):
  """esp_schedule='auto': Parm's Algorithm 1 picks 'baseline', 's1' or 's2' for the layer's shape and the cluster's
  alpha-beta terms when the config is made (`moejax.cost.parm.resolve_auto`); the layer refuses it unresolved."""

  name = "auto"
  needs_resolving = True
