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
expert j is the local router's column j on every node. Group-limited routing (topk_groups < num_groups,
DeepSeek-V2/V3) is the same with groups for nodes: a token's experts are chosen among its best groups of
E / num_groups contiguous experts, so a group's experts may be permuted inside the group or moved together
onto the aligned block of another group. `solve(counts, nodes=num_groups, gpus_per_node=D // num_groups,
routing='node_limited')` finds such placements when num_groups divides the device count D (its flat devices
are the mesh's; its 'nodes' are then the groups' blocks of devices).

What else moves with the experts: the shared experts (`shared`, `shared_gate`) are on every token and
pass through unchanged; of the layer's state (`permute_expert_state`), DeepSeek-V3's balancing bias
`expert_bias` [E] and the earlier micro-batches' choice counts `balance_counts` move with their experts.
A slot table (`slot_expert`, slots_per_device) is refused: its replicas, not the experts' indices, decide
where an expert runs.
"""

from collections.abc import Sequence

import numpy as np

from moejax.moe import routing as routing_lib
from moejax.moe.config import MoEConfig
from moejax.moe.params import EXPERT_PARAMS  # [E, ...]: permuted on axis 0
from moejax.placement.solve import Placement
from moejax.validation import ConfigError, require

SHARED_PARAMS = ("shared", "shared_gate")  # the shared experts and their gate: on every token, unchanged


def expert_order(placement) -> np.ndarray:
  """order [M, E]: order[j, i] = the expert of layer j that moves to index i. Each device's block
  holds its experts in their old order. placement: a Placement or [M, E] flat devices, every device
  (0 .. max) holding the same number of experts in every layer."""
  place = np.asarray(placement.placement if isinstance(placement, Placement) else placement)
  if place.ndim != 2 or not np.issubdtype(place.dtype, np.integer) or place.size == 0 or place.min() < 0:
    raise ConfigError(
      f"placement must be [M, E] non-negative device ids, got shape {place.shape} dtype {place.dtype}",
      "placement",
      place.shape,
      "[M, E] ints >= 0",
    )
  devices = int(place.max()) + 1
  per_device = np.stack([np.bincount(row, minlength=devices) for row in place])
  if np.any(per_device != place.shape[1] // devices) or place.shape[1] % devices:
    raise ConfigError(
      f"placement is unbalanced: experts per device per layer {per_device.tolist()}",
      "placement",
      per_device.tolist(),
      f"{place.shape[1]} / {devices} experts on every device",
    )
  return np.argsort(place, axis=1, kind="stable")


def inverse_order(order) -> np.ndarray:
  """[M, E]: the permutation that undoes `order` [M, E] (index of old expert e after it): applied after
  `order`, every expert is back at its own index."""
  return np.argsort(np.asarray(order), axis=1, kind="stable")


def compose_orders(first, then) -> np.ndarray:
  """[M, E]: the order of applying `first`, then `then` (both [M, E]): index i ends up with the expert
  that `first` put at index then[j, i]."""
  first, then = np.asarray(first), np.asarray(then)
  return np.take_along_axis(first, then, axis=1)


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
  orders = {"expert": lambda: order, "block": lambda: blocks, "local": lambda: local_order(order, cfg)}
  return {name: orders[indexes]() for name, indexes in router.columns.items()}


def permute_experts(params_per_layer: Sequence[dict], order, cfg: MoEConfig) -> list[dict]:
  """One MoE layer's params per MoE layer -> the same with expert order[j, i] of layer j at index i and its
  router column with it (`check_order`); the shared experts and their gate pass through unchanged. numpy or
  jax arrays alike."""
  order = np.asarray(order)
  columns = check_order(order, cfg, len(params_per_layer))
  names = routing_lib.router_names(cfg)
  shared = tuple(name for name, on in zip(SHARED_PARAMS, (cfg.num_shared_experts > 0, cfg.shared_gate)) if on)
  out = []
  for j, params in enumerate(params_per_layer):
    unknown = sorted(set(params) - {*names, *EXPERT_PARAMS, *shared})
    if unknown or any(name not in params for name in (*names, "w_in", "w_out", *shared)):
      expected = ", ".join((*names, "w_in", "w_out", *shared))
      raise ConfigError(
        f"layer {j} params have keys {sorted(params)}; expected {expected}[, w_gate, b_*] for "
        f"routing={cfg.routing!r}, num_shared_experts={cfg.num_shared_experts}, "
        f"shared_gate={cfg.shared_gate}",
        "params",
        sorted(params),
        f"{expected} and optionally w_gate",
      )
    widths = routing_lib.router_widths(cfg)
    for name in names:
      require(
        params[name]["kernel"].shape[-1] == widths[name],
        f"params.{name}",
        params[name]["kernel"].shape,
        f"[d, {widths[name]}] for routing={cfg.routing!r} with num_experts={cfg.num_experts}",
      )
    require(
      params["w_in"].shape[0] == cfg.num_experts,
      "params.w_in",
      params["w_in"].shape,
      f"[E, d, f] with E = num_experts = {cfg.num_experts}",
    )
    new = {name: {key: w[..., columns[name][j]] for key, w in params[name].items()} for name in names}  # kernel, bias
    new.update({name: params[name][order[j]] for name in EXPERT_PARAMS if name in params})
    new.update({name: params[name] for name in shared})
    out.append(new)
  return out


def permute_expert_state(state_per_layer: Sequence[dict], order, cfg: MoEConfig) -> list[dict]:
  """One MoE layer's non-parameter state per MoE layer (the pure-dict `rest` of `MoELayer`) -> the same after
  `permute_experts(..., order, cfg)`: the balancing bias `expert_bias` [E] and the choice counts
  `balance_counts` ([E]; 'bilevel': the node router's [n] then the local router's [E / n]) move with their
  experts, everything else (the key streams) passes through. A slot table (`slot_expert`) is refused: its
  replicas decide where each expert runs, not the experts' indices (re-plan it instead:
  `moejax.replication.rebalance`)."""
  order = np.asarray(order)
  columns = check_order(order, cfg, len(state_per_layer))
  out = []
  for j, state in enumerate(state_per_layer):
    if state.get("slot_expert") is not None:
      raise ConfigError(slot_table_refusal(cfg), "slots_per_device", cfg.slots_per_device, "None")
    new = dict(state)
    if state.get("expert_bias") is not None:
      new["expert_bias"] = state["expert_bias"][order[j]]
    if state.get("balance_counts") is not None:
      counts, start, pieces = np.asarray(state["balance_counts"]), 0, []
      for name, width in cfg.router.widths.items():  # each balanced router's counts, in its columns' new order
        pieces.append(counts[start : start + width][columns[name][j]])
        start += width
      new["balance_counts"] = np.concatenate(pieces)
    out.append(new)
  return out


def slot_table_refusal(cfg: MoEConfig) -> str:
  """Why a model with a slot table is not placed."""
  return (
    f"an expert placement does not apply to MoE layers with a slot table (slots_per_device="
    f"{cfg.slots_per_device}): the table's replicas, not the experts' indices, decide which devices run each "
    "expert (the trainer re-plans it from the loads), so there is no one device per expert to move it to; "
    "plan the table instead (moejax.replication.rebalance), or place a model without slots_per_device"
  )


def check_placement(placement, cfg: MoEConfig, layers: int) -> np.ndarray:
  """The permutation order [M, E] (`expert_order`) of placing a model's `layers` MoE layers of config cfg,
  checked (`check_order`; a slot table is refused) before anything is moved."""
  require(
    isinstance(cfg, MoEConfig),
    "cfg",
    type(cfg).__name__,
    "the layers' MoEConfig (its routing decides which placements keep the outputs)",
  )
  if cfg.slots_per_device is not None:
    raise ConfigError(slot_table_refusal(cfg), "slots_per_device", cfg.slots_per_device, "None")
  order = expert_order(placement)
  check_order(order, cfg, layers)
  return order


def apply_placement(params_per_layer: Sequence[dict], placement, cfg: MoEConfig) -> list[dict]:
  """One MoE layer's params per MoE layer (`moejax.moe.params.param_shapes` layout: the routers,
  w_in [E, d, f], w_out [E, f, d], optional w_gate [E, d, f], and the shared experts `shared` and
  `shared_gate` where cfg has them) -> the same, with experts and router columns permuted so that
  expert e of layer j lands on device placement[j, e]; the shared experts unchanged.

  cfg: the layers' MoEConfig; its routing decides which placements keep the outputs (see the module
  docstring): 'topk' any; 'node_limited' only those keeping every node's experts together
  (`solve(..., routing='node_limited')` finds such); 'bilevel' those, with one local order for every
  node; group-limited routing (num_groups, topk_groups < num_groups) those keeping every group's experts
  together on an aligned block. Other placements raise ConfigError naming the layer and the expert.
  The layer's state moves with `permute_expert_state(state, expert_order(placement), cfg)`.
  """
  require(
    isinstance(cfg, MoEConfig),
    "cfg",
    type(cfg).__name__,
    "the layers' MoEConfig (its routing decides which placements keep the outputs)",
  )
  order = expert_order(placement)
  require(
    len(params_per_layer) == order.shape[0],
    "placement",
    order.shape,
    f"[M, E] with M = {len(params_per_layer)} MoE layers given",
  )
  return permute_experts(params_per_layer, order, cfg)
