"""Inter-layer expert affinity (ExFlow §IV-B): transition counts from routing traces, and the
cross-node / cross-GPU transitions a placement leaves.

A transition is one token moving from its expert at MoE layer j to its expert at layer j+1; it
crosses a GPU (node) when the two experts sit on different devices (nodes). In context-coherent
inference (ExFlow §IV-A) these are exactly the token rows of the one exchange per MoE layer.
"""

import numpy as np

from moejax.validation import ConfigError, is_int, require


def affinity_counts(traces: np.ndarray, num_experts: int) -> np.ndarray:
  """traces [M, T] (expert of token t at MoE layer j) or [M, T, K] (its top-k choices) -> counts
  [M-1, E, E] int64, counts[j, a, b] = tokens with expert a at layer j and b at layer j+1.

  With K choices per token every (choice at j, choice at j+1) pair counts once, K^2 per token and
  layer pair: each of the token's rows at layer j may have to reach each of its experts at j+1.
  Row-normalising counts[j] gives the affinity P(b at j+1 | a at j) of ExFlow's Fig. 2.
  """
  require(is_int(num_experts), "num_experts", num_experts, "a positive int")
  ids = np.asarray(traces)
  if ids.ndim not in (2, 3) or ids.shape[0] < 2:
    raise ConfigError(
      f"traces has shape {ids.shape}; expected [M, T] or [M, T, K] with M >= 2 MoE layers",
      "traces.shape",
      ids.shape,
      "[M, T] or [M, T, K], M >= 2",
    )
  if not np.issubdtype(ids.dtype, np.integer):
    raise ConfigError(
      f"traces must hold integer expert ids, got dtype {ids.dtype}", "traces.dtype", ids.dtype, "an integer dtype"
    )
  if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
    raise ConfigError(
      f"traces holds expert ids in [{ids.min()}, {ids.max()}], outside [0, {num_experts})",
      "traces",
      (int(ids.min()), int(ids.max())),
      f"ids in [0, {num_experts})",
    )
  ids = ids.reshape(ids.shape[0], ids.shape[1], -1).astype(np.int64)  # [M, T, K]
  pairs = ids[:-1, :, :, None] * num_experts + ids[1:, :, None, :]  # [M-1, T, K, K]: a * E + b
  counts = [np.bincount(p.reshape(-1), minlength=num_experts**2) for p in pairs]
  return np.stack(counts).reshape(-1, num_experts, num_experts).astype(np.int64)


def check_counts(counts, nodes: int, gpus_per_node: int) -> np.ndarray:
  """Validates counts [M-1, E, E] (non-negative integers) against a nodes x gpus_per_node mesh."""
  require(is_int(nodes), "nodes", nodes, "a positive int")
  require(is_int(gpus_per_node), "gpus_per_node", gpus_per_node, "a positive int")
  c = np.asarray(counts)
  if c.ndim != 3 or c.shape[1] != c.shape[2] or c.shape[0] < 1 or c.shape[1] < 1:
    raise ConfigError(
      f"counts has shape {c.shape}; expected [M-1, E, E] with M-1 >= 1", "counts.shape", c.shape, "[M-1, E, E]"
    )
  if not (np.issubdtype(c.dtype, np.integer) or np.all(c == np.round(c))):
    raise ConfigError("counts must hold whole numbers of tokens", "counts.dtype", c.dtype, "integer counts")
  if c.min() < 0:
    raise ConfigError(f"counts has a negative entry ({c.min()})", "counts", int(c.min()), "entries >= 0")
  devices = nodes * gpus_per_node
  require(
    c.shape[1] % devices == 0,
    "num_experts",
    c.shape[1],
    f"a multiple of the {devices} devices (nodes={nodes} x gpus_per_node={gpus_per_node}), so that every "
    "device holds E / A experts of every layer",
  )
  return c.astype(np.int64)


def identity_placement(num_layers: int, num_experts: int, devices: int) -> np.ndarray:
  """placement [M, E]: expert e on device e // (E / A) in every layer (the layer's own layout)."""
  return np.tile(np.arange(num_experts) // (num_experts // devices), (num_layers, 1))


def crossings(counts: np.ndarray, part_MxE: np.ndarray) -> int:
  """Transitions between experts in different parts: sum_j sum_{a,b} counts[j, a, b] * [part[j, a] !=
  part[j+1, b]], for counts [M-1, E, E] and part_MxE (the part of every expert: its node, GPU or device)."""
  differ = part_MxE[:-1, :, None] != part_MxE[1:, None, :]  # [M-1, E, E]
  return int(np.sum(np.asarray(counts, np.int64) * differ))


def transitions(counts, placement: np.ndarray, gpus_per_node: int) -> tuple[int, int]:
  """(cross-node, cross-GPU) transitions left by placement [M, E] (flat devices); cross-GPU counts
  every transition between two devices, the cross-node ones included."""
  placement = np.asarray(placement)
  return crossings(counts, placement // gpus_per_node), crossings(counts, placement)
