"""Online re-planning of the MoE layers' replication slot tables (moe.slots_per_device, moe.replan_every).

The loop feeds every step's expert counts [M, E] (summed over the mesh and replicated, so every
process sees the same numbers); every replan_every steps each layer's table becomes
`moejax.replication.rebalance` of the mean of the last replan_window steps' counts. The model does not
change: the layer gathers its slots' weights from the logical experts on every call, so a new table
only moves where the replicas run (and the compiled step is reused: the tables keep their shape).
"""

import collections

import numpy as np

from moejax.replication import rebalance as rebalance_lib


def busiest_loads(counts_MxE, tables_MxAxZ) -> tuple[list[float], list[float]]:
  """Per MoE layer, the busiest holder's load over the mean holder load, (with the slot tables, with
  each holder running only its own E / A experts); 1.0 is perfect balance (and an idle layer)."""
  counts_MxE, tables = np.asarray(counts_MxE, np.float64), np.asarray(tables_MxAxZ)
  identity = rebalance_lib.identity_table(counts_MxE.shape[1], tables.shape[1])
  with_tables = [rebalance_lib.max_load_ratio(c, t) for c, t in zip(counts_MxE, tables)]
  without = [rebalance_lib.max_load_ratio(c, identity) for c in counts_MxE]
  return with_tables, without


class Replanner:
  """Keeps the last `window` steps' expert counts and plans new slot tables from their mean.

  nodes, per_node: the slot table's holders (A = nodes * per_node: the devices, or the nodes with
  expert sharding, per_node = 1); slots: Z, each holder's slots.
  """

  def __init__(self, every: int, window: int, nodes: int, per_node: int, slots: int):
    self.every, self.nodes, self.per_node, self.slots = every, nodes, per_node, slots
    self.counts = collections.deque(maxlen=window)

  def observe(self, counts_MxE) -> None:
    self.counts.append(np.asarray(counts_MxE, np.float64))

  def due(self, step: int) -> bool:
    """Whether the tables are re-planned after `step` (then its counts must have been observed)."""
    return self.every > 0 and step % self.every == 0

  def plan(self) -> np.ndarray:
    """[M, A, Z] int32: each layer's table for the window's mean load (deterministic)."""
    mean_MxE = np.mean(np.stack(self.counts), axis=0)
    return np.stack(
      [rebalance_lib.rebalance(load_E, self.nodes, self.per_node, self.slots) for load_E in mean_MxE]
    ).astype(np.int32)

  def state(self) -> list:
    """The window, for checkpoints (JSON)."""
    return [c.tolist() for c in self.counts]

  def restore(self, window: list) -> None:
    self.counts.clear()
    for counts in window:
      self.observe(counts)
