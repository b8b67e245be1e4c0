"""Lara Mini (`lara_mini`, transformers' LaraMiniForCausalLM): three layer kinds by layer_types (else the released
period [linear, sliding, linear, full, sliding]): Qwen3.5's gated DeltaNet (`linear_attn`: its q, k, v, z, b and a
input projections apart, `DecoderConfig.linear_split_projections`, stored fused by rows in one `linear_attn.in_proj`
as published, [q | k | v | z | b | a]; its gated norm `out_norm`), sliding-window attention with RoPE, and full
attention without RoPE keeping its QK-norm (`nope_qk_norm`); every attention layer Qwen3's (GQA, per-head QK-norm, no
gate). Plain RMSNorm weights. Every layer MoE: softmax of the logits, top-k renormalised with norm_topk_prob, one
shared expert of shared_expert_intermediate_size added in full (no gate), the experts stacked as transformers' modules
hold them (`mlp.experts.gate_up_proj`, `down_proj`: `fused_expert_key`)."""

import dataclasses
import re

from moejax.models import hf_parts
from moejax.models.families.base import Family, fused_expert_key, moe_indices
from moejax.models.families.qwen3_next import LINEAR
from moejax.validation import require

KINDS = {"linear_attention": "gated_deltanet", "sliding_attention": "attention", "full_attention": "attention"}
RELEASED = ["linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention"]
DEFAULTS = {"sliding_window": 512, "norm_topk_prob": True, "head_dim": 128}  # LaraMiniConfig's
IN_PROJ = re.compile(r"\.linear_attn\.in_proj_(qkv|z|b|a)\.weight$")


def _types(hf: dict) -> list:
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types") or [RELEASED[i % len(RELEASED)] for i in range(layers)]
  unknown = sorted(set(types) - set(KINDS))
  require(not unknown and len(types) == layers, "layer_types", types, f"{layers} of {sorted(KINDS)}")
  return types


@dataclasses.dataclass(frozen=True)
class LaraMini(Family):
  qk_norm: bool = True
  attention_bias: bool = True
  hybrid: bool = True

  def hf_name(self, name: str, cfg) -> str:
    fused = IN_PROJ.search(name)
    name = super().hf_name(name, cfg)
    if fused is None:
      return name
    k = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    v, heads = cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads
    sizes = {"qkv": 2 * k + v, "z": v, "b": heads, "a": heads}
    start = sum(list(sizes.values())[: list(sizes).index(fused[1])])
    return hf_parts.rows(
      IN_PROJ.sub(".linear_attn.in_proj.weight", name), start, start + sizes[fused[1]], sum(sizes.values())
    )

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    hf = {**DEFAULTS, **hf}
    kinds = tuple(kind == "sliding_attention" for kind in _types(hf))
    return (hf["sliding_window"], kinds) if any(kinds) and hf["sliding_window"] is not None else (None, None)

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    types = _types(hf)
    nope = tuple(kind == "full_attention" for kind in types)
    return dict(
      super().decoder_fields(hf),
      d_ff=hf["moe_intermediate_size"],  # no dense layer: the experts' width
      mixers=tuple(KINDS[kind] for kind in types),
      nope_layers=nope if any(nope) else None,
      nope_qk_norm=True,
      linear_split_projections=True,
      **{ours: hf[theirs] for theirs, ours in LINEAR.items()},
    )

  def moe_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    fields = dict(
      d_ff=hf["moe_intermediate_size"],
      renormalize=bool(hf["norm_topk_prob"]),
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )
    if hf.get("shared_expert_intermediate_size"):
      fields.update(num_shared_experts=1, shared_d_ff=hf["shared_expert_intermediate_size"])
    return fields

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    return fused_expert_key(path, f"{container}.experts.gate_up_proj", f"{container}.experts.down_proj")

  def to_hf(self, cfg, moe_cfg) -> dict:
    kind = lambda i: (
      "linear_attention"
      if cfg.mixer(i) == "gated_deltanet"
      else "sliding_attention"
      if cfg.window(i)
      else "full_attention"
    )
    types = [kind(i) for i in range(cfg.num_layers)]
    full = tuple(t == "full_attention" for t in types)
    for name, got, want in (
      ("nope_layers", cfg.nope_layers, full if any(full) else None),
      ("nope_qk_norm", cfg.nope_qk_norm, True),
      ("mixers", set(cfg.mixers or ("attention",)) <= {"attention", "gated_deltanet"}, True),
      ("linear_split_projections", cfg.linear_split_projections, True),
      ("gated_attention", cfg.gated_attention, False),
      ("norm_offset", cfg.norm_offset, False),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
      ("moe_layers", len(moe_indices(cfg)), cfg.num_layers),
      ("moe.num_shared_experts", moe_cfg.num_shared_experts, 1),
      ("moe.shared_gate", moe_cfg.shared_gate, False),
    ):
      require(got == want, name, got, f"{want!r}: Lara Mini's config.json cannot say otherwise")
    self.require_plain_router(cfg, moe_cfg, shared_experts=1)
    return {
      "num_experts": moe_cfg.num_experts,
      "num_experts_per_tok": moe_cfg.top_k,
      "moe_intermediate_size": moe_cfg.d_ff,
      "norm_topk_prob": moe_cfg.renormalize,
      "router_aux_loss_coef": moe_cfg.alpha,
      "shared_expert_intermediate_size": moe_cfg.shared_width,
      "attention_bias": cfg.qkv_bias,
      "layer_types": types,
      "sliding_window": cfg.sliding_window,
      **{theirs: getattr(cfg, ours) for theirs, ours in LINEAR.items()},
    }


LARA_MINI = LaraMini(
  "lara_mini",
  "LaraMiniForCausalLM",
  shared_module="shared_expert",
  renames=((r"\.linear_attn\.norm\.", ".linear_attn.out_norm."),),
)
