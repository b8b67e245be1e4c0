"""Who exchanges with whom in a hop, and analytic traffic matrices for points too big to run.

Flat device index of mesh position (node i, gpu j) is i * m + j. A hop runs over 'node', over
'gpu', or over both as one (('node', 'gpu'): the flat exchange); the group of device s holds the
devices that differ from s only along the hop's axes. Traffic matrices are [A, A]: rows (or bytes)
sent from flat device s to flat device p, the layout of the layer's `aux['traffic_rows'][h]`.
"""

import math

import numpy as np

from moejax.runtime import mesh as mesh_lib


def uniform_traffic(n: int, m: int, hop, rows_per_peer: int) -> np.ndarray:
  """[A, A] int: every device sends `rows_per_peer` rows to every member of its group, itself included
  (uniform routing, or a dense exchange with fixed blocks)."""
  return mesh_lib.same_group(hop, n, m).astype(np.int64) * rows_per_peer


def capacity_traffic(n: int, m: int, num_experts: int, capacity: int, hops=(mesh_lib.AXES,)) -> np.ndarray:
  """[hops, A, A]: the dense capacity dispatch (GShard/Switch), whose all_to_all moves every one of the
  E * C slots, padding included: experts_per_gpu * C rows from every device to every device, each hop of a longer
  path a block per peer of that times the sources before it and the devices after it (`moe.path.hop_sizes`)."""
  peers = [mesh_lib.num_peers(hop, n, m) for hop in hops]
  block = num_experts // (n * m) * capacity
  return np.stack(
    [uniform_traffic(n, m, hop, block * math.prod(peers[:h]) * math.prod(peers[h + 1 :])) for h, hop in enumerate(hops)]
  )


def rows_processed(traffic_rows: np.ndarray) -> np.ndarray:
  """[A] rows each device holds after the last hop: the rows its experts compute when each row is one choice
  (without dedup, or the dense dispatch); with dedup a row carries several, and the work is expert_counts."""
  return np.asarray(traffic_rows)[-1].sum(axis=0)
