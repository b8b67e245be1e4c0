"""Upcycling a dense decoder (Llama or Qwen3 layout) into an MoE whose output at step 0 equals the dense model's.

Sparse upcycling (Komatsuzaki et al., 2023): every expert a copy of the layer's FFN. With renormalised weights a
token's output is a convex combination of identical FFNs, so the FFN's, whatever the (random) router says.
Granular upcycling: each copy split into g experts of d_ff / g (copy-major: expert c * g + j is slice j of copy c),
the down projections scaled by g, routing group-limited with the g slices of a copy one group whose router columns
are equal: a token picks top_k copies and all g slices of each, each slice weighted 1 / g of its copy's weight, so
the slices sum back to the copy's FFN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from moejax.models import families
from moejax.models import layers as layers_lib
from moejax.models import state as state_lib
from moejax.models.decoder import Decoder
from moejax.models.sharding import param_specs
from moejax.moe.config import MoEConfig
from moejax.validation import require


def upcycled_moe_config(cfg, num_experts: int, top_k: int, g: int, moe: dict | None) -> MoEConfig:
  """The MoE layer of num_experts copies of the dense FFN, each split into g experts (top_k x g per token: with
  g > 1 a token's g slices come from one copy, the copies being the router's groups)."""
  return MoEConfig.from_mapping(
    dict(
      num_experts=num_experts * g,
      top_k=top_k * g,
      d_model=cfg.d_model,
      d_ff=cfg.d_ff // g,
      gated=True,
      activation="silu",
      renormalize=True,
      dtype=cfg.dtype,
      **({"num_groups": num_experts, "topk_groups": top_k} if g > 1 else {}),
      **(moe or {}),
    ),
    prefix="moe.",
  )


def expert_copies(dense_ffn: dict, num_experts: int, g: int, param_dtype) -> dict:
  """{w_gate, w_in: [E x g, d, d_ff / g], w_out: [E x g, d_ff / g, d]}: copy c's slice j is expert c * g + j; the
  down projection's slices scaled by g, since the router's g weights of a copy sum to 1 / g of the token's."""
  ffn = {k: np.asarray(v["kernel"]) for k, v in dense_ffn.items()}
  split = lambda w, axis: np.stack(np.split(w, g, axis=axis))  # [d, d_ff] or [d_ff, d] -> g slices of d_ff
  slices = {
    "w_gate": split(ffn["gate_proj"], 1),
    "w_in": split(ffn["up_proj"], 1),
    "w_out": split(ffn["down_proj"], 0) * g,
  }
  return {name: np.tile(v, (num_experts, 1, 1)).astype(np.dtype(param_dtype)) for name, v in slices.items()}


def upcycle(
  dense: Decoder,
  *,
  num_experts: int,
  top_k: int = 1,
  granularity: int = 1,
  layers=None,
  moe: dict | None = None,
  seed: int = 0,
) -> Decoder:
  """The MoE decoder whose `layers` (default: all) hold num_experts copies of the dense FFN (each split into
  `granularity` experts), top_k copies per token. moe: more MoEConfig fields (transport, schedule, ...; routing
  fields are upcycling's own). The router is random (normal, std 0.02; the same for a copy's slices)."""
  cfg = dense.cfg
  sources = sorted(name for name, family in families.REGISTRY.items() if family.upcycled_as)  # `Family.upcycled_as`
  require(cfg.family in sources, "family", cfg.family, f"one of {sources} (a dense decoder)")
  require(
    isinstance(granularity, int) and granularity >= 1 and cfg.d_ff % granularity == 0,
    "granularity",
    granularity,
    f"a positive int dividing d_ff={cfg.d_ff}",
  )
  layers = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
  require(all(0 <= i < cfg.num_layers for i in layers), "layers", layers, f"indices of the {cfg.num_layers} layers")
  g = granularity
  moe_cfg = upcycled_moe_config(cfg, num_experts, top_k, g, moe)
  new_cfg = dataclasses.replace(
    cfg, family=families.get(cfg.family).upcycled_as, moe_layers=tuple(i in layers for i in range(cfg.num_layers))
  )
  model = state_lib.build(new_cfg, moe_cfg, dense.mesh, seed)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  source = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
  rng = np.random.default_rng(seed)
  blocks, dense_blocks = layers_lib.per_layer(params, new_cfg), layers_lib.per_layer(source, cfg)
  params = {**params, **{k: v for k, v in source.items() if k not in ("blocks", "segments")}}  # embeddings, norm, head
  for i, block in enumerate(blocks):
    dense_block = dense_blocks[i]
    block.update({k: v for k, v in dense_block.items() if k != "ffn"})
    if i not in layers:
      block["ffn"] = dense_block["ffn"]
      continue
    layer = block["ffn"]["moe"]
    layer.update(expert_copies(dense_block["ffn"], num_experts, g, cfg.param_dtype))
    router = rng.normal(0, 0.02, (cfg.d_model, num_experts)).astype(np.float32)
    layer["router"]["kernel"] = np.repeat(router, g, axis=1)
  params = layers_lib.with_per_layer(params, blocks, new_cfg)
  specs = param_specs(params, moe_cfg)
  place = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(dense.mesh, spec))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(place, params, specs))
  nnx.update(model, state)
  return model
