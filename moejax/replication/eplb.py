"""DeepSeek's EPLB placement (github.com/deepseek-ai/EPLB), re-implemented from its description.

Hierarchical policy, used when the number of nodes divides the number of expert groups (groups are
contiguous blocks of E / num_groups experts, as in DeepSeek-V3's group-limited routing):
  1. pack the groups onto nodes, heaviest first onto the lightest node with room, every node taking
     num_groups / nodes groups;
  2. inside each node, replicate its experts into the node's gpus_per_node * slots_per_device slots, each
     spare slot to the largest load per replica;
  3. pack the node's replicas onto its GPUs the same way, slots_per_device each.
Otherwise the global policy: one node and one group, i.e. replicate over all slots, pack onto all GPUs.
As in EPLB, nothing stops two replicas of an expert from landing on one GPU, and counts have no cap.
"""

import numpy as np

from moejax.replication.rebalance import check_inputs, check_size
from moejax.validation import require


def balanced_packing(weight_E: np.ndarray, packs: int) -> np.ndarray:
  """[N] pack of each item: heaviest first onto the lightest pack that is not full; N / packs items each."""
  capacity = weight_E.size // packs
  pack_of = np.empty(weight_E.size, np.int64)
  total, count = np.zeros(packs), np.zeros(packs, np.int64)
  for item in np.argsort(-weight_E, kind="stable"):
    pack = np.argmin(np.where(count < capacity, total, np.inf))
    pack_of[item] = pack
    total[pack] += weight_E[item]
    count[pack] += 1
  return pack_of


def replicate(load_E: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
  """(replica_expert [slots] logical index of each replica, counts [N]): the N originals, then each spare
  slot to the largest load per replica, in the order they are made (which orders ties when packing)."""
  counts = np.ones(load_E.size, np.int64)
  extra = []
  for _ in range(slots - load_E.size):
    extra.append(np.argmax(load_E / counts))
    counts[extra[-1]] += 1
  return np.concatenate([np.arange(load_E.size), np.asarray(extra, np.int64)]), counts


def _hierarchical(load, groups, nodes, gpus, slots):
  per_group = load.size // groups
  group_node = balanced_packing(load.reshape(groups, per_group).sum(1), nodes)
  slot_expert = np.empty((nodes * gpus, slots), np.int64)
  for node in range(nodes):
    experts = (np.flatnonzero(group_node == node)[:, None] * per_group + np.arange(per_group)).ravel()
    replica, counts = replicate(load[experts], gpus * slots)
    replicas = experts[replica]
    gpu_of = balanced_packing((load[experts] / counts)[replica], gpus)
    for gpu in range(gpus):
      slot_expert[node * gpus + gpu] = replicas[gpu_of == gpu]
  return slot_expert


def eplb(load_E, nodes, gpus_per_node, slots_per_device, num_groups=None) -> np.ndarray:
  """slot_expert [A, slots_per_device] int64 by EPLB for load [E]; num_groups (a divisor of E) defaults to E,
  one expert per group, which gives the node packing the most freedom."""
  load, nodes, gpus, slots = check_inputs(load_E, nodes, gpus_per_node, slots_per_device)
  groups = load.size if num_groups is None else check_size("num_groups", num_groups)
  require(load.size % groups == 0, "num_groups", groups, f"a divisor of the number of experts E={load.size}")
  if groups % nodes:
    return _hierarchical(load, 1, 1, nodes * gpus, slots)
  return _hierarchical(load, groups, nodes, gpus, slots)  # a node's E / nodes experts fit its slots, as E <= A * slots
