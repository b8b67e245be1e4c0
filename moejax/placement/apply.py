"""Applying a placement: permute each MoE layer's experts and router columns once, at load time.

The layer keeps expert at global index i on flat device i // experts_per_gpu (`moejax.moe.layer`), so
putting expert e on device p means moving it to an index in p's block. Moving expert e's weights and
its router column together is a relabelling of the experts: every token picks the same experts with
the same weights, so outputs are unchanged and the layer runs at no extra cost (ExFlow §IV-D).
"""

from collections.abc import Sequence

import numpy as np

from moejax.moe.config import MoEConfig
from moejax.placement.solve import Placement
from moejax.validation import ConfigError, require

EXPERT_PARAMS = ("w_in", "w_out", "w_gate")  # [E, ...]: permuted on axis 0


def expert_order(placement) -> np.ndarray:
  """order [L, E]: order[j, i] = the expert of layer j that moves to index i. Each device's block
  holds its experts in their old order. placement: a Placement or [L, E] flat devices, every device
  (0 .. max) holding the same number of experts in every layer."""
  place = np.asarray(placement.placement if isinstance(placement, Placement) else placement)
  if place.ndim != 2 or not np.issubdtype(place.dtype, np.integer) or place.size == 0 or place.min() < 0:
    raise ConfigError(f"placement must be [L, E] non-negative device ids, got shape {place.shape} dtype {place.dtype}",
                      "placement", place.shape, "[L, E] ints >= 0")
  devices = int(place.max()) + 1
  per_device = np.stack([np.bincount(row, minlength=devices) for row in place])
  if np.any(per_device != place.shape[1] // devices) or place.shape[1] % devices:
    raise ConfigError(f"placement is unbalanced: experts per device per layer {per_device.tolist()}",
                      "placement", per_device.tolist(), f"{place.shape[1]} / {devices} experts on every device")
  return np.argsort(place, axis=1, kind="stable")


def new_index(placement) -> np.ndarray:
  """[L, E]: the index expert e of layer j has after `apply_placement` (maps old traces to new ids)."""
  order = expert_order(placement)
  return np.argsort(order, axis=1)


def apply_placement(params_per_layer: Sequence[dict], placement, cfg: MoEConfig | None = None) -> list[dict]:
  """One MoE layer's params per MoE layer (`moejax.moe.layer.param_shapes` layout: router.kernel
  [d, E], w_in [E, d, f], w_out [E, f, d], optional w_gate [E, d, f]) -> the same, with experts and
  router columns permuted so that expert e of layer j lands on device placement[j, e].

  Only the flat top-k router can be permuted per expert: 'bilevel' has per-node and shared local
  routers, and 'node_limited' ties experts to nodes by index. Pass cfg to have those rejected by its
  routing field; without it a bilevel layer is recognised by its router names.
  """
  if cfg is not None:
    require(cfg.routing == "topk", "routing", cfg.routing,
            "'topk': a placement permutes the flat router's columns (bilevel and node_limited routing tie experts "
            "to nodes by index)")
  order = expert_order(placement)
  require(len(params_per_layer) == order.shape[0], "placement", order.shape,
          f"[L, E] with L = {len(params_per_layer)} MoE layers given")
  out = []
  for j, params in enumerate(params_per_layer):
    if "node_router" in params or "local_router" in params:
      raise ConfigError("a placement cannot be applied to 'bilevel' routing (its routers are per node and per "
                        "local expert, not per expert)", "routing", "bilevel", "'topk'")
    unknown = sorted(set(params) - {"router", *EXPERT_PARAMS})
    if unknown or "router" not in params or "w_in" not in params or "w_out" not in params:
      raise ConfigError(f"layer {j} params have keys {sorted(params)}; expected router, w_in, w_out[, w_gate]",
                        "params", sorted(params), "router, w_in, w_out and optionally w_gate")
    kernel = params["router"]["kernel"]
    require(kernel.shape[-1] == order.shape[1] and params["w_in"].shape[0] == order.shape[1], "placement",
            order.shape, f"E = {kernel.shape[-1]} experts per layer, as the layer's router has")
    new = {"router": {**params["router"], "kernel": kernel[:, order[j]]}}
    new.update({name: params[name][order[j]] for name in EXPERT_PARAMS if name in params})
    out.append(new)
  return out
