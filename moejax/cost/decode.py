"""A decode step's communication priced on a topology (ExFlow): vanilla vs context-coherent.

From what `moejax.infer.decode.Generation` counts per generated token: the MoE exchanges' rows that
stay inside a node (cross-GPU) and that cross nodes, and exflow's all-gather of each new token's
state. A step decodes `batch` tokens (one per request). vanilla runs 2 exchanges per MoE layer
(dispatch, and back home), exflow 1 plus one all-gather per step. The measured rows are spread
evenly over a step's exchanges and, inside one, over the device pairs of their kind (the totals are
measured, the per-pair split is assumed): each exchange is then priced as NCCL runs an all-to-all
(`collectives.all_to_all`) and the all-gather as a ring (`collectives.ring`).
"""

import numpy as np

from moejax.cost import collectives
from moejax.cost.topology import Topology
from moejax.runtime import mesh as mesh_lib
from moejax.validation import is_int, is_number, require

MODES = ("vanilla", "exflow")


def uniform_exchange_bytes(
  in_node_rows: float, cross_node_rows: float, nodes: int, gpus: int, bytes_per_row: float
) -> np.ndarray:
  """[A, A] bytes of one exchange whose in-node and cross-node rows spread evenly over their pairs."""
  devices = nodes * gpus
  cross, inside = mesh_lib.pair_masks(devices, gpus)
  out = np.zeros((devices, devices))
  if inside.any():
    out[inside] = in_node_rows * bytes_per_row / inside.sum()
  if cross.any():
    out[cross] = cross_node_rows * bytes_per_row / cross.sum()
  return out


def decode_step(
  mode: str,
  exchange_rows: dict,
  batch: int,
  moe_layers: int,
  mesh_shape,
  bytes_per_row: float,
  state_bytes: float,
  topology: Topology,
) -> dict:
  """Seconds of one decode step's communication: {'exchange_s', 'allgather_s', 'total_s', 'exchanges'}.

  exchange_rows: {'intra_node', 'inter_node'} rows per generated token (all MoE layers);
  bytes_per_row: one exchanged row; state_bytes: one token's state in exflow's all-gather (its keys
  and values of every block, 2 x d per block, and its id)."""
  require(mode in MODES, "mode", mode, f"one of {MODES}")
  for name, value in (("batch", batch), ("moe_layers", moe_layers)):
    require(is_int(value), name, value, "a positive int")
  for name, value in (("bytes_per_row", bytes_per_row), ("state_bytes", state_bytes)):
    require(is_number(value) and value >= 0, name, value, "a number >= 0")
  nodes, gpus = mesh_shape
  require(
    gpus <= topology["gpus_per_node"],
    "mesh_shape",
    mesh_shape,
    f"at most {topology['gpus_per_node']:g} GPUs per node on {topology.name}",
  )
  exchanges = moe_layers * (2 if mode == "vanilla" else 1)
  per_exchange = {k: exchange_rows[k] * batch / exchanges for k in ("intra_node", "inter_node")}
  bytes_AxA = uniform_exchange_bytes(per_exchange["intra_node"], per_exchange["inter_node"], nodes, gpus, bytes_per_row)
  everyone = np.ones(bytes_AxA.shape, bool)
  one = collectives.all_to_all(bytes_AxA, everyone, gpus, topology)
  gather = (
    collectives.ring("all_gather", batch * state_bytes, nodes, gpus, topology)
    if mode == "exflow"
    else collectives.NOTHING
  )
  exchange_s = exchanges * one.time_s
  return {
    "exchange_s": exchange_s,
    "allgather_s": gather.time_s,
    "total_s": exchange_s + gather.time_s,
    "exchanges": exchanges,
    "one_exchange": one.as_dict(),
  }
