"""Who exchanges with whom in a hop, and analytic traffic matrices for points too big to run.

Flat device index of mesh position (node i, gpu j) is i * m + j. A hop runs over 'node', over
'gpu', or over both as one (('node', 'gpu'): the flat exchange); the group of device s holds the
devices that differ from s only along the hop's axes. Traffic matrices are [D, D]: rows (or bytes)
sent from flat device s to flat device p, the layout of the layer's `aux['traffic_rows'][h]`.
"""

import numpy as np

from moejax import mesh as mesh_lib


def hop_axes(hop) -> tuple[str, ...]:
  """'node' | 'gpu' | ('node', 'gpu') -> the tuple of axis names, checked."""
  axes = (hop,) if isinstance(hop, str) else tuple(hop)
  if not axes or len(set(axes)) != len(axes) or not set(axes) <= set(mesh_lib.AXES):
    raise ValueError(f"hop {hop!r} must be one of {mesh_lib.AXES} or a tuple of them")
  return axes


def group_mask(n: int, m: int, hop) -> np.ndarray:
  """[D, D] bool: s and p are in one group of the hop (s == p included)."""
  flat = np.arange(n * m)
  same_node = (flat[:, None] // m) == (flat[None, :] // m)
  same_gpu = (flat[:, None] % m) == (flat[None, :] % m)
  axes = set(hop_axes(hop))
  if axes == set(mesh_lib.AXES):
    return np.ones((n * m, n * m), bool)
  return same_gpu if axes == {mesh_lib.NODE} else same_node


def uniform_traffic(n: int, m: int, hop, rows_per_peer: int) -> np.ndarray:
  """[D, D] int: every device sends `rows_per_peer` rows to every member of its group, itself included
  (uniform routing, or a dense exchange with fixed blocks)."""
  return group_mask(n, m, hop).astype(np.int64) * rows_per_peer


def capacity_traffic(n: int, m: int, num_experts: int, capacity: int) -> np.ndarray:
  """[1, D, D]: the dense capacity dispatch (GShard/Switch), whose all_to_all moves every one of the
  E * C slots, padding included: experts_per_gpu * C rows to every device."""
  return uniform_traffic(n, m, mesh_lib.AXES, num_experts // (n * m) * capacity)[None]


def rows_processed(traffic_rows: np.ndarray) -> np.ndarray:
  """[D] rows each device holds after the last hop, i.e. the rows its experts compute."""
  return np.asarray(traffic_rows)[-1].sum(axis=0)
