"""The interface of expert sharding (`moe.expert_sharding`): `ExpertParallel`, whole experts over both mesh axes
(EP only), every hook the identity; Parm's schedules (`moe.parm_sharding`) override what they change.

Expert sharding is not a second layer: it decides which tokens or rows a GPU routes and sends, and where a choice's
partial outputs are summed; routing, capacity, the exchange, the schedules and the combine are the layer's own
(`moe.layer`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe import path as path_lib
from moejax.moe import routing
from moejax.runtime import mesh as mesh_lib
from moejax.runtime.mesh import AXES
from moejax.validation import ConfigError, require


class Sent(NamedTuple):
  """The rows one device sends, before replicas and the Dump: x [R, d], each row's logical expert ids [R, K]
  (-1 = not sent) and combine weights [R, K] (0 where not sent), and what `finish` needs to bring the returned
  rows back in token order (S2's slots)."""

  x_RxD: jax.Array
  ids_RxK: jax.Array
  w_RxK: jax.Array
  state: jax.Array | None = None


class ExpertParallel:
  """esp_schedule=None: whole experts over both mesh axes (EP only). The interface of expert sharding, each
  hook the identity; Parm's schedules (`moe.parm_sharding`) override what they change.

  Plain Python (the layout, before tracing): x_axes, the mesh axes x and y are sharded over; routed_over /
  sent_over, the axes along which devices route different tokens / send different rows (what statistics and
  counts are summed over); shared_sum_over / partial_sum_over, the axis over which the shared / routed experts'
  d_ff-slice partial outputs are summed (None: whole experts); needs_vma: the schedule's collectives are typed
  by shard_map's mesh-axis variance; expert_specs / shared_specs: the weights' PartitionSpecs.
  """

  name = None
  needs_resolving = False  # 'auto': a schedule chosen when the config is made (`moejax.cost.parm.resolve_auto`)
  splits_d_ff = False  # each expert's d_ff split over a node's GPUs (Parm)
  dedups_by_default = True  # `MoEConfig.dedup` None resolved
  holder_unit = "devices"  # what holds a slot table's row (`holders`), in errors
  x_axes = AXES
  routed_over = AXES
  sent_over = AXES
  shared_sum_over = None
  partial_sum_over = None
  needs_vma = False
  expert_specs = {name: P(AXES) for name in ("w_in", "w_out", "w_gate", "b_in", "b_out", "b_gate")}
  shared_specs = {"w_in": P(), "w_out": P(), "w_gate": P()}

  def check(self, cfg) -> None:
    """Raises ConfigError naming the field where the config does not fit this sharding."""

  def holders(self, n: int, m: int) -> int:
    """H: what a slot table has a row for on an n x m mesh (`MoEConfig.expert_holders`)."""
    return n * m

  def holders_are(self, n: int, m: int) -> str:
    """What the holders are, for an error on the mesh."""
    return f"{self.holders(n, m)} devices (expert e lives on device e // experts_per_gpu)"

  def experts_per_holder(self, cfg, n: int, m: int) -> int:
    """The experts each holder keeps on an n x m mesh; raises ConfigError naming the field where they do not fit."""
    holders = self.holders(n, m)
    where = self.holders_are(n, m)
    require(cfg.num_experts % holders == 0, "num_experts", cfg.num_experts, f"a multiple of the mesh's {where}")
    require(
      not self.splits_d_ff or cfg.d_ff % m == 0,
      "d_ff",
      cfg.d_ff,
      f"a multiple of the mesh's {m} GPUs per node (each holds d_ff / m of its node's experts)",
    )
    per_holder = cfg.num_experts // holders
    if cfg.slots_per_device is not None:
      require(
        cfg.slots_per_device >= per_holder,
        "slots_per_device",
        cfg.slots_per_device,
        f">= the {per_holder} experts each holder keeps on this mesh",
      )
    return per_holder

  def token_groups(self, n: int, m: int) -> int:
    """The equal groups a call's tokens split into, one per routing device (group)."""
    return n * m

  def check_tokens(self, tokens: int, n: int, m: int) -> None:
    if tokens % (n * m):
      raise ConfigError(f"x has {tokens} tokens, not a multiple of the mesh's {n * m} devices")

  def send_rows(self, cfg, routed_tokens: int, m: int) -> int:
    """The token-choice rows one device sends (before the Dump's copies)."""
    return routed_tokens * cfg.choices_per_token

  def gathered(self, m: int) -> int:
    """Copies of the routed tokens a device sends (the baseline's all-gather)."""
    return 1

  def hops(self, cfg) -> tuple:
    return path_lib.hops(cfg.path)

  def dense_rows_per_slot(self, cfg, routed_tokens: int, m: int) -> int:
    """The capacity collective's block rows per expert slot: every slot of the peer full, for each copy."""
    return routing.expert_capacity(cfg, routed_tokens) * self.gathered(m)

  # Traced, inside shard_map.
  def split_tokens(self, x_TxD):
    """The tokens this device routes, of those it holds."""
    return x_TxD

  def rows_to_send(self, x_TxD, expert_ids_TxK, keep_TxK, w_TxK, rows: int, m: int, cfg) -> Sent:
    """The routed tokens with their K choices; ids -1 and weight 0 where capacity dropped the choice."""
    return Sent(x_TxD, jnp.where(keep_TxK, expert_ids_TxK, -1), jnp.where(keep_TxK, w_TxK, 0.0))

  def holder_index(self, m: int):
    """This device's row of a slot table."""
    return mesh_lib.my_flat_index(m)

  def copies(self, m: int) -> int:
    """Device slots per choice after the Dump."""
    return 1

  def dump(self, holder_ids_RxK, slots: int, m: int):
    """The Dump: choices to devices. Each choice (its holder-level slot id h, -1 = not sent) becomes `copies`
    consecutive slots with device-level ids (device * slots + h % slots) [R, K * copies]; with whole experts a
    holder is a device."""
    return holder_ids_RxK

  def own_rows(self, m: int, *arrays_R):
    """The returned rows of this device's own tokens."""
    return arrays_R

  def finish(self, y_RxD, sent: Sent, dtype):
    """The returned rows [R, d] in token order (rows of tokens, or of token-choices)."""
    return y_RxD

  def gather_tokens(self, a_TxX):
    """Per-token results of the routed tokens -> those of the tokens this device holds."""
    return a_TxX

  def out_bias(self, b_out_GxD):
    """The experts' output biases [G, d] this device adds: all of them with whole experts."""
    return b_out_GxD
