"""The sweep's point models of the 2026 families (`moejax.models.hf_shaped`: DeepSeek-V3.2, GLM-5, DeepSeek-V4,
Qwen3.5, Kimi Linear, MiniMax-M2, LongCat-Flash, MiMo-V2-Flash, Llama 4, GLM-4.7-Flash, ERNIE-4.5, Sarvam, Solar
Open), each the decoder transformers' own config classes describe, nothing rescaled by hand:

- its token mixers, their layer pattern, block structure (mHC streams, ScMoE sublayers) and dense FFN width are the
  record's: `shape` 'published' (the published config.json, the default) or 'tiny' (the test fixture's, for measuring
  on CPU);
- the sweep model gives the residual width d_model, the layers (the first `layers` of the record's pattern, repeated
  where there are more), the vocabulary and the positions; `moe_layers` must be the MoE layers that pattern holds;
- its MoE layers are the sweep's (the moe section's routing in every one: DeepSeek-V4's hash layers route as the
  others), no MTP module.

Outside the MoE layers a point's forward FLOPs are XLA's count of the model it builds (`jax` lowering, unrolled, on
one device), with each MoE layer at one expert of width 1 and that stub's matmuls taken off. XLA's count is the
program that runs with `attention_impl` 'xla': every attention score, the causal half a fused kernel skips
included."""

import dataclasses
import functools
import json

import jax
import numpy as np
from flax import nnx

from moejax.models import hf_config, hf_shaped
from moejax.models.decoder_config import DecoderConfig
from moejax.models.state import abstract_state
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.study import memory_leaves
from moejax.validation import require

SHAPES = {"published": "config", "tiny": "tiny"}  # a sweep model's `shape`: the record's entry it takes
PER_LAYER = ("moe_layers", "mixers", "sliding_layers", "nope_layers")  # DecoderConfig's per-layer tuples
_STUB = dict(num_experts=1, top_k=1, d_ff=1, gated=True)  # the MoE layer XLA's count runs: one expert of width 1


def _first(pattern, layers: int):
  """The first `layers` entries of a per-layer pattern, repeated where it is shorter."""
  return None if pattern is None else type(pattern)(pattern[i % len(pattern)] for i in range(layers))


def _published(family: str, shape: str) -> DecoderConfig:
  return hf_config.from_hf_config(hf_shaped.record(family)[SHAPES[shape]])[0]


def _deepseek_v4_fields(fields: tuple | None, d_model: int, layers: int) -> tuple | None:
  """DeepSeek-V4's attention reads config.json's hidden_size and layer_types itself (JSON values): the sweep's width
  and layers."""
  if fields is None:
    return None
  values = dict(fields)
  values["hidden_size"] = json.dumps(d_model)
  values["layer_types"] = json.dumps(_first(json.loads(values["layer_types"]), layers))
  return tuple(sorted(values.items()))


class HFShapedDecoder:
  """A 2026 family's sweep model (module docstring); `optim`: AdamW, as DeepSeek-V3's point model."""

  takes_shape = True

  def __init__(self, name: str, optim: dict):
    self.name, self.optim = name, optim

  def _shape(self, model) -> str:
    return model.get("shape") or "published"

  def check_layers(self, name: str, model) -> None:
    """ConfigError naming models.<name>.shape or .moe_layers unless they are the record's."""
    shape = self._shape(model)
    require(shape in SHAPES, f"models.{name}.shape", shape, f"one of {tuple(SHAPES)} (the record's shapes)")
    want = sum(_first(_published(self.name, shape).moe_layers, model.layers))
    require(
      model.moe_layers == want,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"{want}: the MoE layers of the first layers={model.layers} of {self.name}'s {shape} pattern",
    )

  def training_model(self, model, dtype: str) -> DecoderConfig:
    cfg = _published(self.name, self._shape(model))
    changes = {field: _first(getattr(cfg, field), model.layers) for field in PER_LAYER}
    return dataclasses.replace(
      cfg,
      **changes,
      vocab_size=model.vocab,
      num_layers=model.layers,
      d_model=model.d_model,
      max_len=model.seq_len,
      hash_layers=None,
      num_mtp_layers=0,
      deepseek_v4=_deepseek_v4_fields(cfg.deepseek_v4, model.d_model, model.layers),
      dtype=dtype,
      param_dtype=dtype,
    )

  def forward_flops(self, model, gated: bool) -> float:
    del gated  # the record's dense FFNs are what they are
    return _forward_flops(self.training_model(model, "float32"), model.micro_batch, model.seq_len)

  def dense_params(self, model, routers: float, gated: bool) -> float:
    del gated
    cfg = self.training_model(model, "float32")
    stub = _stub(cfg)
    size = memory_leaves.size
    layers = sum(
      size(memory_leaves.layer_leaves(cfg, stub, layer)) - (size(memory_leaves.moe_leaves(stub)) if moe else 0)
      for layer, moe in enumerate(cfg.moe_layers)
    )
    return float(size(memory_leaves.top_leaves(cfg)) + layers + routers)


def _stub(cfg: DecoderConfig) -> MoEConfig:
  return MoEConfig(d_model=cfg.d_model, **_STUB)


@functools.lru_cache(maxsize=64)
def _forward_flops(cfg: DecoderConfig, micro_batch: int, seq_len: int) -> float:
  """XLA's FLOPs of `cfg`'s forward on [micro_batch, seq_len] tokens, less its stub MoE layers' matmuls (a router
  column and the expert's three 1-wide matrices: 2 T d x 4 a layer)."""
  cfg = dataclasses.replace(cfg, scan_layers=False, attention_impl="xla")  # XLA counts a scanned body once
  graphdef, params, rest = abstract_state(cfg, _stub(cfg), mesh_lib.make_mesh(1, 1))
  forward = lambda p, r, tokens: nnx.merge(graphdef, p, r)(tokens)[0]
  tokens = jax.ShapeDtypeStruct((micro_batch, seq_len), np.int32)
  cost = jax.jit(forward).lower(params, rest, tokens).cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  return float(flops - sum(cfg.moe_layers) * 2 * micro_batch * seq_len * cfg.d_model * 4)
