"""Applying a placement: permute each MoE layer's experts and router columns once, at load time.

The layer keeps expert at global index i on flat device i // experts_per_gpu (`moejax.moe.layer`), so
putting expert e on device p means moving it to an index in p's block. Moving expert e's weights and
its router column together is a relabelling of the experts: every token picks the same experts with
the same weights, so outputs are unchanged and the layer runs at no extra cost (ExFlow §IV-D).

The node routings limit which relabellings keep the outputs: a node's (or a group's) experts stay together
(`moejax.placement.order_checks`).

What else moves with the experts: the shared experts (`shared`, `shared_gate`) are on every token and
pass through unchanged; of the layer's state (`permute_expert_state`), DeepSeek-V3's balancing bias
`expert_bias` [E] and the earlier micro-batches' choice counts `balance_counts` move with their experts, and with
routing='hash' the index each hashed expert sits at (`hash_index`) follows it (a hash names the same expert, which
now sits elsewhere); the table of each token id's experts (`hash_table`, hash_vocab) passes through unchanged: it names
experts in their original numbering, which `hash_index` maps.
A slot table (`slot_expert`, slots_per_device) is refused: its replicas, not the experts' indices, decide
where an expert runs.
"""

from collections.abc import Sequence

import numpy as np

from moejax.moe import routing as routing_lib
from moejax.moe.config import MoEConfig
from moejax.moe.params import EXPERT_PARAMS  # [E, ...]: permuted on axis 0
from moejax.placement.order_checks import check_order
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


def padded_order(order_E, size: int) -> np.ndarray:
  """A layer's expert order [E] extended to `size` columns: zero experts (ids E .. size - 1) stay where they are."""
  order_E = np.asarray(order_E)
  return np.concatenate([order_E, np.arange(len(order_E), size)])


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
      new["expert_bias"] = state["expert_bias"][padded_order(order[j], len(state["expert_bias"]))]
    if state.get("hash_index") is not None:  # expert e, at index hash_index[e], moves to where order puts that index
      index = np.asarray(state["hash_index"])
      new["hash_index"] = inverse_order(padded_order(order[j], len(index))[None])[0][index].astype(index.dtype)
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
  together on an aligned block; 'hash' any, routing through the moved `hash_index`. Other placements raise
  ConfigError naming the layer and the expert. The layer's state moves with
  `permute_expert_state(state, expert_order(placement), cfg)` (with 'hash' its `hash_index`, which the layer needs:
  `moe_apply(hash_index=)`).
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
