"""OLMoE (`olmoe`, AllenAI): GQA whose QK-norm is one RMSNorm over the whole q projection [num_heads x head_dim] and
one over the whole k projection [num_kv_heads x head_dim] (not per head; `qk_norm_mode='projection'`), then q, k and v
clipped to +-clip_qkv where config.json sets it; attention_bias biases q, k, v and o alike. Every FFN is the MoE layer:
softmax top-k, renormalised only with norm_topk_prob (default false: the raw probabilities weigh the experts), no shared
experts, the experts' width intermediate_size. Checkpoint keys as Qwen2-MoE's (`mlp.gate`,
`mlp.experts.E.gate_proj`).

`ProjectionQkNorm` is what MiniMax-M2 (`families/minimax_m2.py`) shares with it: the attention, every layer MoE,
one intermediate_size, no sliding window (neither transformers class has one).
"""

import dataclasses

from moejax.models import qk_norm
from moejax.models.families.base import Family, moe_indices
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class ProjectionQkNorm(Family):
  """GQA with QK-norm over the whole projections, every FFN the MoE layer."""

  qk_norm: bool = True

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # the transformers classes build a causal mask without a window whatever config.json says

  def decoder_fields(self, hf: dict) -> dict:
    return {**super().decoder_fields(hf), "qk_norm_mode": qk_norm.PROJECTION.name}

  def require_layout(self, cfg, moe_cfg) -> None:
    """Refuses, by the field, a decoder this family's config.json cannot say: a dense layer, a dense width other
    than the experts', QK-norm other than over the projections, a sliding window, attention sinks."""
    require(
      len(moe_indices(cfg)) == cfg.num_layers,
      "moe_layers",
      cfg.moe_layers,
      f"all True ({cfg.family} has no dense layers)",
    )
    require(
      moe_cfg.d_ff == cfg.d_ff, "moe.d_ff", moe_cfg.d_ff, f"the decoder's d_ff={cfg.d_ff} (one intermediate_size)"
    )
    for name, want in (("qk_norm", True), ("qk_norm_mode", qk_norm.PROJECTION.name), ("sliding_window", None)):
      require(getattr(cfg, name) == want, name, getattr(cfg, name), f"{want!r} ({cfg.family}'s attention)")
    require(not cfg.attention_sinks, "attention_sinks", cfg.attention_sinks, f"False ({cfg.family}'s attention)")


@dataclasses.dataclass(frozen=True)
class Olmoe(ProjectionQkNorm):
  attention_bias: bool = True

  def decoder_fields(self, hf: dict) -> dict:
    return {**super().decoder_fields(hf), "clip_qkv": hf.get("clip_qkv")}

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["intermediate_size"],
      renormalize=bool(hf.get("norm_topk_prob", False)),
      load_balance_coef=hf.get("router_aux_loss_coef", 0.01),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    self.require_layout(cfg, moe_cfg)
    # transformers' q_norm is hidden_size wide: the heads must tile the model width
    width = cfg.d_model // cfg.num_heads
    require(cfg.head_dim == width, "head_dim", cfg.head_dim, f"d_model / num_heads = {width} (OLMoE's q_norm)")
    require(cfg.out_bias == cfg.qkv_bias, "out_bias", cfg.out_bias, f"qkv_bias={cfg.qkv_bias} (attention_bias)")
    return dict(
      num_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      norm_topk_prob=moe_cfg.renormalize,
      router_aux_loss_coef=moe_cfg.alpha,
      attention_bias=cfg.qkv_bias,
      clip_qkv=cfg.clip_qkv,
    )


OLMOE = Olmoe("olmoe", "OlmoeForCausalLM")
