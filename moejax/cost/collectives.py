"""Collectives priced as NCCL runs them on a `Topology`.

All-to-all (ragged or fixed-size): each device posts one send and one receive to every other member
of its group, whether or not it has rows for it (NCCL's pairwise loop; SMILE Fig. 2). Per-message
costs add up on each device, while bytes flow at once over each GPU's intra-node link and each
node's NICs, which the node's GPUs share:

  t = launch + max_s sum_{p in group(s), p != s} latency(s, p)
             + max(max_node max(bytes out, bytes in over its NICs) / nic_bw,
                   max_s max(bytes out, bytes in inside its node) / intra_bw)

latency(s, p) is inter_latency when s and p sit on different nodes, else intra_latency. Rows a
device keeps cost nothing; a hop whose groups are single devices launches nothing.

Ring all-gather / reduce-scatter / all-reduce follow NCCL's ring model: G - 1 steps (2 (G - 1) for
all-reduce) of which nodes - 1 (2 (nodes - 1)) cross NICs, and every ring edge carries
(G - 1) / G of the buffer (twice for all-reduce) at the slowest link of the ring.
"""

import dataclasses

import numpy as np

from moejax.cost.topology import Topology


@dataclasses.dataclass(frozen=True)
class ExchangeCost:
  """One collective: its time and the terms it is made of.

  latency_s: the per-message sum of the slowest device; bandwidth_s: the busiest link's bytes over
  its bandwidth. messages_inter / messages_intra: messages of that slowest device. nic_bytes: the
  busiest node's max(out, in) over NICs; intra_bytes: the busiest GPU's max(out, in) inside its node.
  """

  time_s: float
  launch_s: float
  latency_s: float
  bandwidth_s: float
  messages_inter: int
  messages_intra: int
  nic_bytes: float
  intra_bytes: float
  crosses_nodes: bool

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


NOTHING = ExchangeCost(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, False)


def all_to_all(bytes_AxA: np.ndarray, group_AxA: np.ndarray, m: int, topology: Topology) -> ExchangeCost:
  """One all-to-all moving bytes_AxA[s, p] from flat device s to p; group_AxA[s, p]: s and p exchange.

  m: GPUs per node of the mesh (flat device s sits on node s // m).
  """
  bytes_AxA = np.asarray(bytes_AxA, np.float64)
  group_AxA = np.asarray(group_AxA, bool)
  num_devices = bytes_AxA.shape[0]
  if bytes_AxA.shape != (num_devices, num_devices) or group_AxA.shape != bytes_AxA.shape or num_devices % m:
    raise ValueError(f"traffic {bytes_AxA.shape} and group {group_AxA.shape} must be [A, A] with A a multiple of m={m}")
  if np.any(bytes_AxA[~group_AxA] != 0):
    s, p = np.argwhere((bytes_AxA != 0) & ~group_AxA)[0]
    raise ValueError(f"traffic from device {s} to device {p}, which do not exchange in this hop")
  node_A = np.arange(num_devices) // m
  inter_AxA = node_A[:, None] != node_A[None, :]
  message_AxA = group_AxA & ~np.eye(num_devices, dtype=bool)
  if not message_AxA.any():
    return NOTHING

  inter_msgs_A = (message_AxA & inter_AxA).sum(axis=1)
  intra_msgs_A = (message_AxA & ~inter_AxA).sum(axis=1)
  latency_A = inter_msgs_A * topology["inter_latency"] + intra_msgs_A * topology["intra_latency"]
  slowest = int(np.argmax(latency_A))

  inter_bytes = np.where(inter_AxA, bytes_AxA, 0.0)
  nodes = num_devices // m
  node_out = inter_bytes.sum(axis=1).reshape(nodes, m).sum(axis=1)
  node_in = inter_bytes.sum(axis=0).reshape(nodes, m).sum(axis=1)
  intra_bytes = np.where(~inter_AxA & message_AxA, bytes_AxA, 0.0)
  nic_bytes = float(max(node_out.max(), node_in.max()))
  gpu_bytes = float(max(intra_bytes.sum(axis=1).max(), intra_bytes.sum(axis=0).max()))
  bandwidth_s = max(nic_bytes / topology["nic_bw"], gpu_bytes / topology["intra_bw"])

  launch_s = topology["launch"]
  return ExchangeCost(
    time_s=launch_s + float(latency_A[slowest]) + bandwidth_s,
    launch_s=launch_s,
    latency_s=float(latency_A[slowest]),
    bandwidth_s=bandwidth_s,
    messages_inter=int(inter_msgs_A[slowest]),
    messages_intra=int(intra_msgs_A[slowest]),
    nic_bytes=nic_bytes,
    intra_bytes=gpu_bytes,
    crosses_nodes=bool(inter_msgs_A.any()),
  )


RING_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def ring(
  kind: str, buffer_bytes: float, nodes: int, gpus: int, topology: Topology, concurrent: int = 1
) -> ExchangeCost:
  """A ring collective over `nodes` x `gpus` devices (gpus per node in the group).

  buffer_bytes: the full buffer (all-gather output, reduce-scatter input, all-reduce buffer).
  concurrent: identical rings running at once that share each node's NICs (e.g. one gradient
    all-reduce over 'node' per GPU of the node: concurrent = m).
  """
  if kind not in RING_KINDS:
    raise ValueError(f"ring kind {kind!r} is not one of {RING_KINDS}")
  size = nodes * gpus
  if size == 1:
    return NOTHING
  rounds = 2 if kind == "all_reduce" else 1
  steps, inter_steps = rounds * (size - 1), rounds * (nodes - 1)
  latency_s = (steps - inter_steps) * topology["intra_latency"] + inter_steps * topology["inter_latency"]
  edge_bytes = rounds * (size - 1) / size * buffer_bytes
  link_bw = topology["intra_bw"] if nodes == 1 else min(topology["intra_bw"], topology["nic_bw"] / concurrent)
  bandwidth_s = edge_bytes / link_bw
  launch_s = topology["launch"]
  return ExchangeCost(
    time_s=launch_s + latency_s + bandwidth_s,
    launch_s=launch_s,
    latency_s=latency_s,
    bandwidth_s=bandwidth_s,
    messages_inter=inter_steps,
    messages_intra=steps - inter_steps,
    nic_bytes=edge_bytes * concurrent if nodes > 1 else 0.0,
    intra_bytes=edge_bytes if gpus > 1 else 0.0,
    crosses_nodes=nodes > 1,
  )
