"""Expert sharding: where each expert's weights live and which tokens or rows each device routes and sends.

One interface, `ExpertParallel` (`moe.expert_parallel`), one object per value of `MoEConfig.esp_schedule`
(`SHARDINGS`: None = whole experts over both mesh axes; Parm's 'baseline', 's1', 's2' and 'auto',
`moe.parm_sharding`), and `ExpertDataParallel` (here) for `MoEConfig.expert_data_parallel`. `chosen(cfg)` is the
config's (`MoEConfig.sharding_kind`, 'auto' included); `of(cfg)` the one a layer runs, which must be concrete.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe.expert_parallel import ExpertParallel
from moejax.moe.parm_sharding import S1, S2, Auto, Baseline
from moejax.runtime.mesh import GPU, NODE
from moejax.validation import require


class ExpertDataParallel(ExpertParallel):
  """expert_data_parallel: experts over the node's GPUs only (expert e on GPU e // (E / m) of every node),
  replicated over 'node'. A token's experts are all in its own node, so its rows take one hop over 'gpu'; the
  experts' weights are unvarying over 'node', so shard_map sums their gradients over it (check_vma)."""

  name = "expert_data_parallel"
  holder_unit = "GPUs per node"
  needs_vma = True
  expert_specs = {name: P(GPU) for name in ("w_in", "w_out", "w_gate", "b_in", "b_out", "b_gate")}

  def check(self, cfg):
    require(
      cfg.esp_schedule is None and not cfg.router.chooses_nodes and not cfg.path_kind.crosses_axes_apart,
      "expert_data_parallel",
      True,
      "False with esp_schedule, the node routings or a two-hop path: its experts are "
      "replicated over 'node', which Parm shards them over, and every node holds every expert, so there is no "
      "node to choose and no inter-node hop to take",
    )

  def holders(self, n, m):
    return m

  def holders_are(self, n, m):
    return f"{m} GPUs per node (expert data parallelism)"

  def hops(self, cfg):
    return (GPU,)

  def holder_index(self, m):
    return jax.lax.axis_index(GPU)

  def dump(self, holder_ids_RxK, slots, m):  # to the GPU holding the slot in this node
    return jnp.where(holder_ids_RxK >= 0, holder_ids_RxK + jax.lax.axis_index(NODE) * m * slots, -1)


SHARDINGS = {s.name: s for s in (ExpertParallel(), Baseline(), S1(), S2(), Auto())}
EXPERT_DATA_PARALLEL = ExpertDataParallel()


def chosen(cfg) -> ExpertParallel:
  """The expert sharding the config chose: expert data parallelism, or that of cfg.esp_schedule ('auto' too)."""
  return EXPERT_DATA_PARALLEL if cfg.expert_data_parallel else SHARDINGS[cfg.esp_schedule]


def of(cfg) -> ExpertParallel:
  """The expert sharding of cfg.esp_schedule ('auto' must be resolved when the config is made)."""
  require(
    not SHARDINGS[cfg.esp_schedule].needs_resolving,
    "esp_schedule",
    cfg.esp_schedule,
    "a concrete schedule: resolve 'auto' when "
    "the config is made (moejax.cost.parm.resolve_auto(cfg, tokens, nodes, gpus_per_node); the trainer does)",
  )
  return chosen(cfg)
