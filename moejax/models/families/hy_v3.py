"""HY V3 (`hy_v3`, Tencent's Hy3): Qwen3's attention (GQA, an explicit head_dim, per-head RMSNorm of q and k before
RoPE, no biases, no sliding window); MoE layers by mlp_layer_types ('dense' or 'sparse' per layer; default the first
dense), the rest dense SwiGLU FFNs of intermediate_size.

Routing: MiniMax-M2's (`families/minimax_m2.py`): sigmoid of the router's logits (float32), the top-k of sigmoid +
the MoE block's balancing bias (`mlp.expert_bias`, a buffer of the block, not the router's), the chosen sigmoids
renormalised, then x router_scaling_factor (`MoEConfig.routed_scaling`); a shared expert (`mlp.shared_mlp`, width
moe_intermediate_size x num_shared_experts) added unscaled. Checkpoint keys as published (transformers' WeightRenaming
of hy_v3, reversed): the router `mlp.router.gate.weight`, the bias `mlp.expert_bias`, the shared expert
`mlp.shared_mlp.*`, the experts per expert as Qwen3-MoE's. HYV3Config's defaults where config.json is silent (theta
11158840, eps 1e-5); enable_moe_fp32_combine only says where bfloat16 rounds the shared and routed sum, which moejax
adds in its compute dtype. The published MTP layer (`model.layers.80.*`) is ignored on load as transformers ignores it.
"""

import dataclasses

from moejax.models.families.base import Family
from moejax.models.families.deepseek import V3_BIAS_RATE
from moejax.validation import require

DEFAULTS = {"rms_norm_eps": 1e-5, "num_shared_experts": 1, "router_scaling_factor": 2.826}  # HYV3Config's
DEFAULT_THETA = 11_158_840.0


@dataclasses.dataclass(frozen=True)
class HyV3(Family):
  qk_norm: bool = True

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path == ["expert_bias"]:  # the balancing bias is the MoE block's buffer
      return f"{container}.expert_bias", False
    return None

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    return tuple(kind == "sparse" for kind in kinds)

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # transformers' causal mask has no window whatever config.json says

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    fields = {**super().decoder_fields(hf), "rms_eps": hf["rms_norm_eps"]}
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    fields = dict(
      d_ff=hf["moe_intermediate_size"],
      score="sigmoid",
      renormalize=True,
      routed_scaling=float(hf["router_scaling_factor"]),
      bias_update_rate=V3_BIAS_RATE,  # the checkpoint's bias, loaded while the layer keeps one
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )
    if hf["num_shared_experts"]:
      fields.update(num_shared_experts=hf["num_shared_experts"], shared_d_ff=hf["moe_intermediate_size"])
    return fields

  def to_hf(self, cfg, moe_cfg) -> dict:
    if cfg.num_moe_layers:
      for name, got, want in (
        ("moe.score", moe_cfg.score, "sigmoid"),
        ("moe.renormalize", moe_cfg.renormalize, True),
        ("moe.num_groups", moe_cfg.num_groups, None),
        ("moe.shared_gate", moe_cfg.shared_gate, False),
        ("moe.shared_d_ff", moe_cfg.shared_d_ff or moe_cfg.d_ff, moe_cfg.d_ff),
      ):
        require(got == want, name, got, f"{want!r}: HY V3's config.json cannot say otherwise")
      # the checkpoint holds the routing bias, which the layer keeps only while it balances
      rate = moe_cfg.bias_update_rate
      require(rate > 0, "moe.bias_update_rate", rate, "> 0 (the routing bias expert_bias)")
    for name, got, want in (
      ("qk_norm", cfg.qk_norm, True),
      ("qk_norm_mode", cfg.qk_norm_mode, "head"),
      ("qkv_bias", cfg.qkv_bias, False),
      ("out_bias", cfg.out_bias, False),
      ("sliding_window", cfg.sliding_window, None),
      ("attention_sinks", cfg.attention_sinks, False),
      ("clip_qkv", cfg.clip_qkv, None),
    ):
      require(got == want, name, got, f"{want!r}: HY V3's config.json cannot say otherwise")
    return dict(
      mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)],
      num_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      num_shared_experts=moe_cfg.num_shared_experts,
      router_scaling_factor=moe_cfg.routed_scaling,
      attention_bias=False,
      router_aux_loss_coef=moe_cfg.alpha,
    )


HY_V3 = HyV3(
  "hy_v3",
  "HYV3ForCausalLM",
  shared_module="shared_mlp",
  renames=((r"\.mlp\.gate\.weight$", ".mlp.router.gate.weight"),),
  ignored=(r"model\.layers\.80\.",),
)
