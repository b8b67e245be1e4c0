"""A model with its experts placed (ExFlow §IV-D): `with_placement` permutes every MoE layer's experts so that
expert e of MoE layer j runs on flat device placement[j, e], and the model remembers the order (`expert_order`),
which `moejax.models.to_hf` undoes. Used by `from_hf(..., placement=)` and by decoding (`moejax.infer.decode`
re-exports it)."""

import jax
from flax import nnx

from moejax.models import layers as layers_lib
from moejax.models import state as state_lib
from moejax.models.config import moe_block_indices
from moejax.placement import apply as apply_lib


def with_placement(model, placement):
  """The model (a SMILE `LanguageModel` or a family's `Decoder`) with every MoE layer's experts and router
  columns permuted so that expert e of MoE layer j sits on flat device placement[j, e]
  (`moejax.placement.apply_placement`; a `Placement` or [M, E] ints over the M MoE layers of `model.blocks`;
  a `Decoder`'s MTP modules, which decoding does not run, keep their order). Outputs are unchanged; only where
  the experts run moves. The shared experts stay; the balancing bias (`expert_bias`) and the choice counts move
  with their experts. With node routings or group-limited routing the placement must keep every node's /
  group's experts together (`solve(..., routing=...)`), else ConfigError naming the layer and expert; a model
  with a slot table (slots_per_device) is refused (its replicas decide where experts run).

  The new model remembers its expert order: `expert_order[j][i]` is the checkpoint's (logical) expert of MoE
  layer j at index i (composed when a placed model is placed again), which `moejax.models.to_hf` undoes.
  """
  moe_blocks = moe_block_indices(model.cfg)
  order = apply_lib.check_placement(placement, model.moe_cfg, len(moe_blocks))
  graphdef, abstract_params, abstract_rest = state_lib.abstract_state(model.cfg, model.moe_cfg, model.mesh)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  # Layer by layer (a scanned segment's repeats sliced, then stacked again: `moejax.models.layers`).
  layer_params, layer_rest = layers_lib.per_layer(params, model.cfg), layers_lib.per_layer(rest, model.cfg)
  placed = apply_lib.permute_experts([layer_params[i]["ffn"]["moe"] for i in moe_blocks], order, model.moe_cfg)
  placed_state = apply_lib.permute_expert_state([layer_rest[i]["ffn"]["moe"] for i in moe_blocks], order, model.moe_cfg)
  for i, layer, state in zip(moe_blocks, placed, placed_state):
    layer_params[i] = {**layer_params[i], "ffn": {**layer_params[i]["ffn"], "moe": layer}}
    layer_rest[i] = {**layer_rest[i], "ffn": {**layer_rest[i]["ffn"], "moe": state}}
  params = layers_lib.with_per_layer(params, layer_params, model.cfg)
  rest = layers_lib.with_per_layer(rest, layer_rest, model.cfg)
  put = lambda a, like: jax.device_put(a, like.sharding)
  new = nnx.merge(graphdef, jax.tree.map(put, params, abstract_params), jax.tree.map(put, rest, abstract_rest))
  before = getattr(model, "expert_order", None)
  total = order if before is None else apply_lib.compose_orders(before, order)
  new.expert_order = tuple(tuple(int(e) for e in row) for row in total)  # static: kept out of the state
  return new
