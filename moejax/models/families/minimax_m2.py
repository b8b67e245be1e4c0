"""MiniMax-M2 (`minimax_m2`): OLMoE's attention without biases or clipping (QK-norm over the whole q and k
projections; `families/olmoe.py`), an explicit head_dim and partial RoPE (the first rotary_dim dimensions of each
head, half-split; transformers 5 reads rotary_dim as rope_parameters.partial_rotary_factor = rotary_dim / head_dim).
Every FFN is the MoE layer, routed as DeepSeek-V3 without groups or scaling: sigmoid scores, the choice by score +
e_score_correction_bias (`block_sparse_moe.e_score_correction_bias`, the MoE block's, not the router's), the
chosen scores renormalised; no shared experts. Checkpoint keys as Mixtral's (`block_sparse_moe.gate`,
`block_sparse_moe.experts.E.w1` gate, `w3` up, `w2` down).

transformers reads none of the published config.json's use_qk_norm, qk_norm_type, scoring_func, use_routing_bias
or MTP fields (its attention and router are these whatever they say), and neither does moejax.
"""

import dataclasses

from moejax.models.families.deepseek import V3_BIAS_RATE
from moejax.models.families.olmoe import ProjectionQkNorm
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class MiniMaxM2(ProjectionQkNorm):
  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path == ["expert_bias"]:  # the balancing bias is the MoE block's buffer
      return f"{container}.e_score_correction_bias", False
    return None

  def decoder_fields(self, hf: dict) -> dict:
    fields = super().decoder_fields(hf)
    rope = hf.get("rope_parameters") or {}
    if hf.get("rotary_dim") and "partial_rotary_factor" not in rope and "partial_rotary_factor" not in hf:
      fields["partial_rotary_factor"] = hf["rotary_dim"] / fields["head_dim"]  # a config.json of the hub's
    return fields

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["intermediate_size"],
      score="sigmoid",
      renormalize=True,
      bias_update_rate=V3_BIAS_RATE,
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
      jitter=hf.get("router_jitter_noise", 0.0),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_layout(cfg, moe_cfg)
    for name, got, want in (
      ("moe.score", moe_cfg.score, "sigmoid"),
      ("moe.renormalize", moe_cfg.renormalize, True),
      ("moe.num_groups", moe_cfg.num_groups, None),
      ("moe.routed_scaling", moe_cfg.routed_scaling, 1.0),
      ("moe.num_shared_experts", moe_cfg.num_shared_experts, 0),
      ("qkv_bias", cfg.qkv_bias, False),
      ("out_bias", cfg.out_bias, False),
      ("clip_qkv", cfg.clip_qkv, None),
    ):
      require(got == want, name, got, f"{want!r}: MiniMax-M2's config.json cannot say otherwise")
    # the checkpoint holds the routing bias, which the layer keeps only while it balances
    require(moe_cfg.bias_update_rate > 0, "moe.bias_update_rate", moe_cfg.bias_update_rate, "> 0 (the routing bias)")
    return dict(
      num_local_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      router_aux_loss_coef=moe_cfg.alpha,
      router_jitter_noise=moe_cfg.jitter,
    )


MINIMAX_M2 = MiniMaxM2(
  "minimax_m2",
  "MiniMaxM2ForCausalLM",
  moe_module="block_sparse_moe",
  expert_names={"w_gate": "w1", "w_in": "w3", "w_out": "w2"},
)
