"""What an exchange must move, counted from the routing alone, and DeepEP's volume (experiments/wire_traffic.py
measures the layer against both): the rows each hop must move, DeepEP's rows over RDMA, and the bytes of one row on
moejax's wire and on DeepEP's.
"""

import numpy as np

from moejax.moe import wire as wire_lib
from moejax.runtime import mesh as mesh_lib

ITEMSIZE = 4  # float32 activations
# wire name -> (dispatch_dtype, combine_dtype)
WIRES = {"fp32": (None, None), "bf16": ("bfloat16", "bfloat16"), "fp8": (wire_lib.FP8, "bfloat16")}


def bound_rows(
  ids_TxK: np.ndarray, num_experts: int, devices: int, gpus_per_node: int, hops, dedup: bool = True
) -> np.ndarray:
  """[hops, A, A] rows each hop must move from flat device s to p, from the routing alone: token t starts on
  device t // (T / A), expert e lives on device e // (E / A); a hop over 'node' ('gpu') replaces the node (GPU
  index) of where a choice is with its expert's. dedup: one row per (token, device it is at, destination);
  else one per choice. ids_TxK: [T, K] global expert ids."""
  tokens, k = ids_TxK.shape
  m = gpus_per_node
  dest_TxK = ids_TxK // (num_experts // devices)
  at_TxK = np.broadcast_to((np.arange(tokens) // (tokens // devices))[:, None], (tokens, k))
  token_TxK = np.broadcast_to(np.arange(tokens)[:, None], (tokens, k))
  out = []
  for hop in hops:
    axes = mesh_lib.hop_axes(hop)
    node = np.where(mesh_lib.NODE in axes, dest_TxK // m, at_TxK // m)
    gpu = np.where(mesh_lib.GPU in axes, dest_TxK % m, at_TxK % m)
    to_TxK = node * m + gpu
    moves = np.stack([token_TxK.ravel(), at_TxK.ravel(), to_TxK.ravel()], axis=1)
    if dedup:
      moves = np.unique(moves, axis=0)
    traffic = np.zeros((devices, devices), np.int64)
    np.add.at(traffic, (moves[:, 1], moves[:, 2]), 1)
    out.append(traffic)
    at_TxK = to_TxK
  return np.stack(out)


def deepep_rows(ids_TxK: np.ndarray, num_experts: int, devices: int, gpus_per_node: int) -> int:
  """Rows DeepEP sends over RDMA: each token once per node of its experts other than its own."""
  tokens = ids_TxK.shape[0]
  node_TxK = ids_TxK // (num_experts // devices) // gpus_per_node
  own_T = np.arange(tokens) // (tokens // devices) // gpus_per_node
  return sum(len(set(nodes) - {own}) for nodes, own in zip(node_TxK.tolist(), own_T.tolist()))


def row_bytes(wire: str, d: int, slots: int) -> dict:
  """Bytes of one row on the wire (as `moejax.moe.traffic.traffic_bytes` counts them with no receive bound):
  out: the payload in the dispatch dtype (FP8's scales included) and each slot's int32 id and float32 weight;
  back: the result in the combine dtype."""
  row = wire_lib.row_bytes(d, slots, ITEMSIZE, *WIRES[wire])
  return {"out": row.dispatch, "back": row.combine}


def deepep_payload_bytes(d: int) -> dict:
  """DeepEP's volume per row: FP8 e4m3 with a float32 scale per 128 elements out, BF16 back."""
  return {"out": d + 4 * -(-d // 128), "back": 2 * d}


def deepep_message_bytes(d: int, top_k: int) -> dict:
  """DeepEP's RDMA message per token as its internode kernels size it (csrc/kernels/internode.cu,
  `get_num_bytes_per_token`: hidden bytes + SourceMeta (two int32) + float32 scales + int32 top-k ids + float32
  top-k weights, rounded up to 16 bytes); the combine sends the BF16 hidden, SourceMeta and top-k weights."""

  def align16(b):
    return -(-b // 16) * 16

  return {"out": align16(d + 8 + 4 * -(-d // 128) + 8 * top_k), "back": align16(2 * d + 8 + 4 * top_k)}


def split(traffic_AxA: np.ndarray, gpus_per_node: int) -> tuple[int, int]:
  """(inter-node, intra-node) rows of an [A, A] matrix, the diagonal left out."""
  cross, inside = mesh_lib.pair_masks(traffic_AxA.shape[0], gpus_per_node)
  return int(traffic_AxA[cross].sum()), int(traffic_AxA[inside].sum())
