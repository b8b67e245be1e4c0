"""Mellum (`mellum`, JetBrains' Mellum2): Qwen3-MoE's decoder (GQA, an explicit head_dim, per-head RMSNorm of q and k
before RoPE, attention_bias on q, k, v and o alike) with full_attention and sliding_attention layers by layer_types
(default: all full; sliding_window keys, 1024 by default), each layer type its own RoPE theta (rope_parameters
{'full_attention': {...}, 'sliding_attention': {...}}, default RoPE each; MellumConfig's thetas 5e5 and 1e4 where
silent): the sliding layers' theta is `DecoderConfig.sliding_overrides`, MiMo-V2-Flash's mechanism. MoE layers by
mlp_layer_types ('dense' or 'sparse'; default all sparse), the rest dense SwiGLU FFNs of intermediate_size; softmax
top-k renormalised with norm_topk_prob (default true), no shared expert; checkpoint keys as Qwen3-MoE's. The published
MTP layer (`mtp.*`) is ignored on load as transformers ignores it.
"""

import dataclasses

from moejax.models.families.base import Family
from moejax.validation import require

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULTS = {"sliding_window": 1024, "norm_topk_prob": True, "head_dim": 128}  # MellumConfig's, where they differ
DEFAULT_ROPE = {
  FULL: {"rope_type": "default", "rope_theta": 500_000.0},
  SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
}


def _rope_theta(hf: dict, kind: str) -> float:
  """The RoPE theta of the layers of `kind`, refused unless their RoPE is the default one over the whole head (the
  rotary embedding of transformers' Mellum rotates the whole head whatever the factor: a smaller one fails there)."""
  rope = hf.get("rope_parameters") or DEFAULT_ROPE
  params = rope.get(kind) if isinstance(rope.get(kind), dict) else {}
  plain = params.get("rope_type", "default") == "default" and params.get("partial_rotary_factor", 1.0) == 1.0
  require(
    params.get("rope_theta") is not None and plain,
    "rope_parameters",
    rope,
    f"a default RoPE over the whole head (rope_theta) for each layer type, {kind!r} included (Mellum's)",
  )
  return float(params["rope_theta"])


@dataclasses.dataclass(frozen=True)
class Mellum(Family):
  qk_norm: bool = True
  attention_bias: bool = True

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return tuple(kind == "sparse" for kind in hf.get("mlp_layer_types") or ["sparse"] * layers)

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    kinds = tuple(kind == SLIDING for kind in hf.get("layer_types") or [FULL] * layers)
    return ({**DEFAULTS, **hf}["sliding_window"], kinds) if any(kinds) else (None, None)

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    kinds = set(hf.get("layer_types") or [FULL])
    full = _rope_theta(hf, FULL if FULL in kinds else SLIDING)
    fields = dict(super().decoder_fields(hf), rope_theta=full, rope_scaling=None, partial_rotary_factor=1.0)
    if SLIDING in kinds and _rope_theta(hf, SLIDING) != full:
      fields["sliding_overrides"] = (("rope_theta", _rope_theta(hf, SLIDING)),)
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    return dict(
      d_ff=hf["moe_intermediate_size"],
      renormalize=bool(hf["norm_topk_prob"]),
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    sliding = [i for i in range(cfg.num_layers) if cfg.window(i)]
    own = cfg.at(sliding[0]) if sliding else cfg
    overrides = {name for name, _ in cfg.sliding_overrides or ()}
    for name, got, want in (
      ("sliding_overrides", sorted(overrides - {"rope_theta"}), []),
      ("qk_norm", cfg.qk_norm, True),
      ("qk_norm_mode", cfg.qk_norm_mode, "head"),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
      ("clip_qkv", cfg.clip_qkv, None),
      ("attention_sinks", cfg.attention_sinks, False),
      ("rope_interleaved", cfg.rope_interleaved, False),
      ("rope_scaling", cfg.rope_scaling, None),
      ("partial_rotary_factor", cfg.partial_rotary_factor, 1.0),
    ):
      require(got == want, name, got, f"{want!r}: Mellum's config.json cannot say otherwise")
    rope = lambda c: {"rope_type": "default", "rope_theta": c.rope_theta}
    return dict(
      mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)],
      num_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      norm_topk_prob=moe_cfg.renormalize,
      router_aux_loss_coef=moe_cfg.alpha,
      attention_bias=cfg.qkv_bias,
      rope_parameters={FULL: rope(cfg), SLIDING: rope(own)},
    )

  def sliding_to_hf(self, cfg) -> dict:
    # MellumConfig's default sliding_window would otherwise be read back; layer_types says no layer slides
    return super().sliding_to_hf(cfg) or dict(layer_types=[FULL] * cfg.num_layers)


MELLUM = Mellum("mellum", "MellumForCausalLM", attention_fields=("sliding_overrides",), ignored=(r"^mtp\.",))
