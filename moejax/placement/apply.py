"""Applying a placement: permute each MoE layer's experts and router columns once, at load time.

The layer keeps expert at global index i on flat device i // experts_per_gpu (`moejax.moe.layer`), so
putting expert e on device p means moving it to an index in p's block. Moving expert e's weights and
its router column together is a relabelling of the experts: every token picks the same experts with
the same weights, so outputs are unchanged and the layer runs at no extra cost (ExFlow §IV-D).

The node routings limit which relabellings keep the outputs. Their nodes are the contiguous blocks
of E / n indices, and which experts share a node is part of the model: 'node_limited' ranks a
token's nodes by the scores of the node's own experts, and 'bilevel' picks a node, then a local
expert j with one local router shared by all nodes. So a node's experts may be permuted inside the
node or moved together to another node (its router column goes along: the node router's for
'bilevel'), never split; for 'bilevel' every node must also keep the same local order, since local
expert j is the local router's column j on every node.
"""

from collections.abc import Sequence

import numpy as np

from moejax.moe import routing as routing_lib
from moejax.moe.config import NODE_ROUTINGS, MoEConfig
from moejax.placement.solve import Placement
from moejax.validation import ConfigError, require

EXPERT_PARAMS = ("w_in", "w_out", "w_gate")  # [E, ...]: permuted on axis 0


def expert_order(placement) -> np.ndarray:
  """order [M, E]: order[j, i] = the expert of layer j that moves to index i. Each device's block
  holds its experts in their old order. placement: a Placement or [M, E] flat devices, every device
  (0 .. max) holding the same number of experts in every layer."""
  place = np.asarray(placement.placement if isinstance(placement, Placement) else placement)
  if place.ndim != 2 or not np.issubdtype(place.dtype, np.integer) or place.size == 0 or place.min() < 0:
    raise ConfigError(f"placement must be [M, E] non-negative device ids, got shape {place.shape} dtype {place.dtype}",
                      "placement", place.shape, "[M, E] ints >= 0")
  devices = int(place.max()) + 1
  per_device = np.stack([np.bincount(row, minlength=devices) for row in place])
  if np.any(per_device != place.shape[1] // devices) or place.shape[1] % devices:
    raise ConfigError(f"placement is unbalanced: experts per device per layer {per_device.tolist()}",
                      "placement", per_device.tolist(), f"{place.shape[1]} / {devices} experts on every device")
  return np.argsort(place, axis=1, kind="stable")


def node_order(order: np.ndarray, cfg: MoEConfig) -> np.ndarray:
  """[M, n]: the old node whose experts node h holds after the permutation order [M, E], for a node
  routing; raises ConfigError naming the layer and expert when a node's experts would be split."""
  per_node, layers = cfg.experts_per_node, order.shape[0]
  new_node = np.argsort(order, axis=1).reshape(layers, cfg.num_nodes, per_node) // per_node  # [M, n old, E / n]
  split = np.any(new_node != new_node[:, :, :1], axis=-1)  # [M, n old]
  if split.any():
    j, node = np.argwhere(split)[0]
    to = new_node[j, node]
    most = np.bincount(to).argmax()
    expert, mate = node * per_node + np.flatnonzero(to != most)[0], node * per_node + np.flatnonzero(to == most)[0]
    reason = ("node_limited ranks a token's nodes by their own experts' probabilities" if cfg.routing == "node_limited"
              else "bilevel picks a node, then one of its experts by the local router shared by all nodes")
    raise ConfigError(
        f"the placement moves expert {expert} of MoE layer {j} from node {node} to node {to[expert % per_node]} "
        f"while expert {mate} of the same node goes to node {most}. With routing={cfg.routing!r} the experts that "
        f"share a node are part of the model ({reason}), so splitting a node changes which experts a token is routed "
        "to. A placement may permute experts within their node or move a node's experts together.",
        "placement", (int(j), int(expert), int(to[expert % per_node])),
        f"node-preserving placements for routing={cfg.routing!r}: every node's {per_node} experts stay together")
  return order[:, ::per_node] // per_node


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
        "experts must keep the same local order.", "placement", (int(j), int(expert), int(slot)),
        "placements that give every node the same local permutation for 'bilevel'")
  return local[:, 0]


def apply_placement(params_per_layer: Sequence[dict], placement, cfg: MoEConfig) -> list[dict]:
  """One MoE layer's params per MoE layer (`moejax.moe.params.param_shapes` layout: the routers,
  w_in [E, d, f], w_out [E, f, d], optional w_gate [E, d, f]) -> the same, with experts and router
  columns permuted so that expert e of layer j lands on device placement[j, e].

  cfg: the layers' MoEConfig; its routing decides which placements keep the outputs (see the module
  docstring): 'topk' any; 'node_limited' only those keeping every node's experts together
  (`solve(..., routing='node_limited')` finds such); 'bilevel' those, with one local order for every
  node. Other placements raise ConfigError naming the layer and the expert.
  """
  require(isinstance(cfg, MoEConfig), "cfg", type(cfg).__name__,
          "the layers' MoEConfig (its routing decides which placements keep the outputs)")
  order = expert_order(placement)
  require(len(params_per_layer) == order.shape[0], "placement", order.shape,
          f"[M, E] with M = {len(params_per_layer)} MoE layers given")
  require(order.shape[1] == cfg.num_experts, "placement", order.shape,
          f"[M, E] with E = num_experts = {cfg.num_experts}")
  # New column c of a router holds old column columns[name][j, c].
  columns = {"router": order}
  if cfg.routing in NODE_ROUTINGS:
    nodes = node_order(order, cfg)
    if cfg.routing == "bilevel":
      columns = {"node_router": nodes, "local_router": local_order(order, cfg)}
  names = routing_lib.router_names(cfg)
  out = []
  for j, params in enumerate(params_per_layer):
    unknown = sorted(set(params) - {*names, *EXPERT_PARAMS})
    if unknown or any(name not in params for name in (*names, "w_in", "w_out")):
      raise ConfigError(f"layer {j} params have keys {sorted(params)}; expected {', '.join(names)}, w_in, w_out"
                        f"[, w_gate] for routing={cfg.routing!r}", "params", sorted(params),
                        f"{', '.join(names)}, w_in, w_out and optionally w_gate")
    widths = routing_lib.router_widths(cfg)
    for name in names:
      require(params[name]["kernel"].shape[-1] == widths[name], f"params.{name}", params[name]["kernel"].shape,
              f"[d, {widths[name]}] for routing={cfg.routing!r} with num_experts={cfg.num_experts}")
    require(params["w_in"].shape[0] == cfg.num_experts, "params.w_in", params["w_in"].shape,
            f"[E, d, f] with E = num_experts = {cfg.num_experts}")
    new = {name: {**params[name], "kernel": params[name]["kernel"][:, columns[name][j]]} for name in names}
    new.update({name: params[name][order[j]] for name in EXPERT_PARAMS if name in params})
    out.append(new)
  return out
