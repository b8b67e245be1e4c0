"""The sweep's point models: SMILE's BERT-MoE and decoders shaped like DeepSeek-V3 and Qwen3-MoE, one object per family
(`FAMILIES`, by name). What a measured point trains (`training_model`, `optimizer`), what a modelled point's step counts
outside its MoE layers (`forward_flops`, `dense_params`) and where the MoE layers may sit (`check_layers`): each a
question the family object answers, never a comparison of its name.

A sweep model (config.models.<name>) gives d_model, d_ff (the experts' width), layers, moe_layers, seq_len,
micro_batch and vocab; its `family` the rest:
  bert         SMILE's BERT-MoE (`moejax.models` ModelConfig kind 'bert'): every (layers / moe_layers)-th FFN an
               MoE layer, heads of width 64, dropout 0.1 as in SMILE, LAMB (SMILE Sec. 4.1); its MLM head runs on
               the masked 15% of the tokens. The dense FFNs are d_ff wide.
  deepseek_v3  a causal decoder with DeepSeek-V3's multi-head latent attention (`moejax.models.presets.PUBLISHED`),
  qwen3_moe    or Qwen3-MoE's grouped-query attention with QK-norm: the published model at the sweep model's width,
               i.e. its head count, latent ranks and dense FFN width times d_model / the published d_model
               (rounded, at least 1; the key-value heads a divisor of the query heads), each head as wide as
               published; the dense layers first (layers - moe_layers of them, DeepSeek's order), no MTP module,
               AdamW (DeepSeek-V3 report: b1 0.9, b2 0.95, weight decay 0.1); next-token loss on every token.
The MoE layer itself (top-k, shared experts, gating, routing) is the moe section's (models.<name>.moe per model).
"""

import math

from moejax.cost import model as cost_model
from moejax.models import hf_shaped
from moejax.models.config import ModelConfig
from moejax.models.decoder_config import DecoderConfig
from moejax.models.presets import PUBLISHED
from moejax.study import memory, memory_leaves
from moejax.study.hf_point_models import HFShapedDecoder
from moejax.train import objective
from moejax.validation import require

DECODER_FIELDS = (
  "rope_theta",
  "rope_interleaved",
  "qk_norm",
  "rms_eps",
  "head_dim",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
)  # taken from the published model as they are

# LAMB as in SMILE (Sec. 4.1) for 'bert', AdamW as in DeepSeek-V3's report for the decoders; a step's cost does not
# depend on these values.
TIMING_OPTIM = {
  "learning_rate": 1e-3,
  "warmup_steps": 0,
  "decay": "linear",
  "decay_steps": 0,
  "end_fraction": 0.0,
  "b1": 0.9,
  "b2": 0.999,
  "eps": 1e-6,
  "weight_decay": 0.01,
  "clip_norm": 1.0,
}
DECODER_OPTIM = {**TIMING_OPTIM, "name": "adamw", "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _scaled(value: int, ratio: float) -> int:
  return max(1, round(value * ratio))


def _matrix_params(leaves) -> int:
  """Weights of the matrices (2-D leaves) among `leaves`: each costs 2 FLOPs per token."""
  return sum(math.prod(leaf.shape) * leaf.count for leaf in leaves if len(leaf.shape) == 2)


class SweepFamily:
  """A family of sweep models; `optim`: the optim section its measured points train with."""

  optim = DECODER_OPTIM
  takes_shape = False  # a model's `shape` (which record): the 2026 families' (`hf_point_models`)

  def __init__(self, name: str):
    self.name = name

  def check_layers(self, name: str, model) -> None:
    """ConfigError naming models.<name>.moe_layers unless the family can place `model`'s MoE layers."""
    require(
      model.moe_layers <= model.layers,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"at most layers={model.layers} (the others are dense, first)",
    )


class PublishedDecoder(SweepFamily):
  """A causal decoder shaped like the published model `name` at the sweep model's width (module docstring)."""

  def training_model(self, model, dtype: str) -> ModelConfig | DecoderConfig:
    published = PUBLISHED[self.name]
    shape, ratio = published.model, model.d_model / published.moe["d_model"]
    heads = _scaled(shape["num_heads"], ratio)
    kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= _scaled(shape["num_kv_heads"], ratio))
    latent = {rank: _scaled(shape[rank], ratio) for rank in ("q_lora_rank", "kv_lora_rank") if rank in shape}
    return DecoderConfig(
      family=self.name,
      vocab_size=model.vocab,
      num_layers=model.layers,
      d_model=model.d_model,
      d_ff=_scaled(shape["d_ff"], ratio),
      num_heads=heads,
      num_kv_heads=kv_heads,
      max_len=model.seq_len,
      **{k: shape[k] for k in DECODER_FIELDS if k in shape},
      **latent,
      moe_layers=(False,) * (model.layers - model.moe_layers) + (True,) * model.moe_layers,
      dtype=dtype,
    )

  def forward_flops(self, model, gated: bool) -> float:
    del gated  # the published dense FFNs are gated
    tokens = model.micro_batch * model.seq_len
    cfg = self.training_model(model, "float32")
    top, attention, ffn = memory.decoder_leaves(cfg)
    dense_layers = cfg.num_layers - cfg.num_moe_layers
    weights = (
      _matrix_params(top)
      - cfg.vocab_size * cfg.d_model  # the embedding is a lookup
      + cfg.num_layers * _matrix_params(attention)
      + dense_layers * _matrix_params(ffn)
    )
    qk, v = (
      (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.latent else (cfg.head_dim, cfg.head_dim)
    )
    scores = cfg.num_layers * 2 * tokens * model.seq_len * cfg.num_heads * (qk + v) / 2
    return 2 * tokens * weights + scores

  def dense_params(self, model, routers: float, gated: bool) -> float:
    del gated
    cfg = self.training_model(model, "float32")
    top, attention, ffn = memory.decoder_leaves(cfg)
    size = memory_leaves.size
    return float(
      size(top) + cfg.num_layers * size(attention) + (cfg.num_layers - cfg.num_moe_layers) * size(ffn) + routers
    )


class BertMoE(SweepFamily):
  """SMILE's BERT-MoE: an MoE layer every layers / moe_layers blocks, LAMB, the MLM head on the masked tokens."""

  optim = TIMING_OPTIM

  def check_layers(self, name: str, model) -> None:
    require(
      model.layers % model.moe_layers == 0,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"a divisor of layers={model.layers} (an MoE layer every layers / moe_layers blocks)",
    )

  def training_model(self, model, dtype: str) -> ModelConfig | DecoderConfig:
    heads = model.d_model // 64 if model.d_model % 64 == 0 else 1
    return ModelConfig(
      kind="bert",
      vocab_size=model.vocab,
      num_layers=model.layers,
      d_model=model.d_model,
      num_heads=heads,
      d_ff=model.d_ff,
      max_len=model.seq_len,
      dropout=0.1,
      moe_every=model.layers // model.moe_layers,
      dtype=dtype,
    )

  def forward_flops(self, model, gated: bool) -> float:
    tokens = model.micro_batch * model.seq_len
    predicted = model.micro_batch * objective.num_predictions(model.seq_len)
    return cost_model.non_moe_flops(
      tokens, model.seq_len, model.d_model, model.d_ff, model.layers, model.moe_layers, model.vocab, gated, predicted
    )

  def dense_params(self, model, routers: float, gated: bool) -> float:
    ffn = (3 if gated else 2) * model.d_model * model.d_ff
    return (
      model.layers * 4 * model.d_model**2
      + (model.layers - model.moe_layers) * ffn
      + model.vocab * model.d_model
      + routers
    )


# SMILE's BERT-MoE, the decoders (their dense layers first), then the 2026 families (`hf_point_models`).
FAMILIES = {
  f.name: f
  for f in (
    BertMoE("bert"),
    PublishedDecoder("deepseek_v3"),
    PublishedDecoder("qwen3_moe"),
    *(HFShapedDecoder(name, DECODER_OPTIM) for name in hf_shaped.FAMILIES),
  )
}


def family(model) -> str:
  """The sweep model's family ('bert' where it names none)."""
  return model.get("family", "bert")


def training_model(model, dtype: str) -> ModelConfig | DecoderConfig:
  """The model a measured point trains (module docstring); checked by its constructor (errors name its field)."""
  return FAMILIES[family(model)].training_model(model, dtype)


def optimizer(model) -> dict:
  """The optim section of a measured point's training step."""
  return FAMILIES[family(model)].optim


def forward_flops(model, gated: bool) -> float:
  """Forward FLOPs per device of one micro batch (T = micro_batch x seq_len tokens) outside the MoE layers.

  bert: `cost.model.non_moe_flops` (attention 8 d^2 + 4 seq d per token, the dense FFNs, the MLM head on the masked
  tokens; `gated`: the moe section's, which the dense FFNs share). Decoders: 2 T per weight of every matrix of the
  attention (all layers), the dense FFNs (gated) and the output head, plus causal attention's scores and weighted
  sum, 2 T seq (q-k width + v width) per head and layer, halved by the mask."""
  return FAMILIES[family(model)].forward_flops(model, gated)


def dense_params(model, moe_replicated: float, gated: bool) -> float:
  """Parameters replicated on every device and all-reduced each step: all but the routed experts (sharded, one
  copy each). bert: attention (4 d^2 a layer), the dense FFNs and the embedding; decoders: every tensor of
  `memory.decoder_leaves` (embedding, head, norms, attention, dense FFNs); both: `moe_replicated` per MoE layer
  (its routers and shared experts)."""
  return FAMILIES[family(model)].dense_params(model, model.moe_layers * moe_replicated, gated)
