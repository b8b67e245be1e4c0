"""Which expert orders keep a model's outputs: a permutation order [M, E] (order[j, i]: the expert of layer j that
moves to index i) checked against the layers' routing, and the router columns' new order
(`moejax.placement.apply` permutes the weights with them).

The node routings limit which relabellings keep the outputs. Their nodes are the contiguous blocks
of E / n indices, and which experts share a node is part of the model: 'node_limited' ranks a
token's nodes by the scores of the node's own experts, and 'bilevel' picks a node, then a local
expert j with one local router shared by all nodes. So a node's experts may be permuted inside the
node or moved together to another node (its router column goes along: the node router's for
'bilevel'), never split; for 'bilevel' every node must also keep the same local order, since local
expert j is the local router's column j on every node. Group-limited routing (topk_groups < num_groups,
DeepSeek-V2/V3) is the same with groups for nodes: a token's experts are chosen among its best groups of
E / num_groups contiguous experts, so a group's experts may be permuted inside the group or moved together
onto the aligned block of another group. `solve(counts, nodes=num_groups, gpus_per_node=D // num_groups,
routing='node_limited')` finds such placements when num_groups divides the device count D (its flat devices
are the mesh's; its 'nodes' are then the groups' blocks of devices).
"""

import numpy as np

from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, require


def _split_block(order: np.ndarray, per_block: int):
  """(layer, block, expert, its new block, a mate, the mate's new block) of the first block of per_block
  contiguous experts that the permutation order [M, E] splits over several aligned new blocks, or None."""
  layers, blocks = order.shape[0], order.shape[1] // per_block
  new_block = np.argsort(order, axis=1).reshape(layers, blocks, per_block) // per_block  # [M, old block, E / n]
  split = np.any(new_block != new_block[:, :, :1], axis=-1)  # [M, old block]
  if not split.any():
    return None
  j, block = np.argwhere(split)[0]
  to = new_block[j, block]
  most = np.bincount(to).argmax()
  expert, mate = block * per_block + np.flatnonzero(to != most)[0], block * per_block + np.flatnonzero(to == most)[0]
  return int(j), int(block), int(expert), int(to[expert % per_block]), int(mate), int(most)


def block_order(order: np.ndarray, cfg: MoEConfig) -> np.ndarray:
  """[M, blocks]: the old block whose experts block h holds after the permutation order [M, E], for a routing
  whose blocks of contiguous experts (nodes, groups: `Router.placement_blocks`) stay whole; raises ConfigError
  naming the layer and expert when a block's experts would be split."""
  blocks = cfg.router.placement_blocks
  per_block, unit = cfg.num_experts // blocks.count, blocks.unit
  split = _split_block(order, per_block)
  if split is None:
    return order[:, ::per_block] // per_block
  j, block, expert, to, mate, most = split
  if unit == "node":
    raise ConfigError(
      f"the placement moves expert {expert} of MoE layer {j} from node {block} to node {to} "
      f"while expert {mate} of the same node goes to node {most}. With routing={cfg.routing!r} the experts that "
      f"share a node are part of the model ({blocks.reason}), so splitting a node changes which experts a token "
      "is routed to. A placement may permute experts within their node or move a node's experts together.",
      "placement",
      (j, expert, to),
      f"node-preserving placements for routing={cfg.routing!r}: every node's {per_block} experts stay together",
    )
  raise ConfigError(
    f"the placement moves expert {expert} of MoE layer {j} from {unit} {block} to the block of {unit} {to} "
    f"while expert {mate} of the same {unit} goes to the block of {unit} {most}. {blocks.reason[0].upper()}"
    f"{blocks.reason[1:]}, so the experts that share a {unit} are part of the model and splitting a {unit} "
    f"changes which experts a token is routed to. A placement may permute experts within their {unit} or move "
    f"a {unit}'s experts together onto another {unit}'s aligned block of {per_block} (solve(counts, "
    f"nodes={blocks.count}, gpus_per_node=devices // {blocks.count}, routing='node_limited') finds such "
    f"placements when {blocks.count} divides the devices).",
    "placement",
    (j, expert, to),
    f"{unit}-preserving placements for num_groups={blocks.count}: every {unit}'s {per_block} experts stay "
    "together on an aligned block",
  )


def local_order(order: np.ndarray, cfg: MoEConfig) -> np.ndarray:
  """[M, E / n]: the old local expert at each local index after the permutation order [M, E] for
  'bilevel' routing, the same on every node; raises ConfigError naming the layer and expert otherwise."""
  per_node = cfg.experts_per_node
  local = order.reshape(order.shape[0], cfg.num_nodes, per_node) % per_node  # [M, n new, E / n]
  differ = local != local[:, :1]
  if differ.any():
    j, node, slot = np.argwhere(differ)[0]
    expert = order[j, node * per_node + slot]
    raise ConfigError(
      f"the placement gives the nodes of MoE layer {j} different local orders: at local indices 0 .. "
      f"{per_node - 1} node 0 would hold its old local experts {local[j, 0].tolist()} and node {node} "
      f"{local[j, node].tolist()} (expert {expert} would be local expert {slot} of node {node}). With "
      "routing='bilevel' local expert j is the shared local router's column j on every node, so every node's "
      "experts must keep the same local order.",
      "placement",
      (int(j), int(expert), int(slot)),
      "placements that give every node the same local permutation for 'bilevel'",
    )
  return local[:, 0]


def check_order(order, cfg: MoEConfig, layers: int | None = None) -> dict:
  """Checks a permutation order [M, E] (order[j, i]: the expert of layer j that moves to index i) against the
  layers' config: one permutation of the E experts per layer (M = layers if given), keeping every node of
  the node routings and every group of group-limited routing together (module docstring). Returns, per
  router of the routing, the router columns [M, width] in their new order; raises ConfigError naming the
  layer and the expert."""
  require(
    isinstance(cfg, MoEConfig),
    "cfg",
    type(cfg).__name__,
    "the layers' MoEConfig (its routing decides which placements keep the outputs)",
  )
  order = np.asarray(order)
  if layers is not None:
    require(
      order.ndim == 2 and order.shape[0] == layers,
      "placement",
      order.shape,
      f"[M, E] with M = {layers} MoE layers given",
    )
  require(
    order.ndim == 2 and order.shape[1] == cfg.num_experts,
    "placement",
    order.shape,
    f"[M, E] with E = num_experts = {cfg.num_experts}",
  )
  require(
    np.issubdtype(order.dtype, np.integer) and np.all(np.sort(order, axis=1) == np.arange(cfg.num_experts)),
    "order",
    order.tolist(),
    f"one permutation of 0 .. {cfg.num_experts - 1} per MoE layer",
  )
  router = cfg.router
  blocks = None if router.placement_blocks is None else block_order(order, cfg)
  # Zero-computation experts (ids E .. E+Z-1) hold no parameters and sit on no device: their columns stay put.
  zeros = np.broadcast_to(
    np.arange(cfg.num_experts, cfg.num_experts + cfg.zero_experts), (len(order), cfg.zero_experts)
  )
  experts = np.concatenate([order, zeros], axis=1) if cfg.zero_experts else order
  orders = {"expert": lambda: experts, "block": lambda: blocks, "local": lambda: local_order(order, cfg)}
  return {name: orders[indexes]() for name, indexes in router.columns.items()}
