"""Mixtral (`mixtral`): GQA with an optional sliding window over every layer, every FFN the MoE layer (softmax top-k,
renormalised); checkpoint keys `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down)."""

import dataclasses

from moejax.models.families.base import Family, moe_indices
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class Mixtral(Family):
  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return hf.get("sliding_window"), None  # one window for every layer, no layer_types

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["intermediate_size"],
      renormalize=True,
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
      jitter=hf.get("router_jitter_noise", 0.0),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    require(
      len(moe_indices(cfg)) == cfg.num_layers, "moe_layers", cfg.moe_layers, "all True (Mixtral has no dense layers)"
    )
    require(not cfg.qkv_bias, "qkv_bias", cfg.qkv_bias, "False (Mixtral's attention has no biases)")
    return dict(
      num_local_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      sliding_window=cfg.sliding_window,
      router_aux_loss_coef=moe_cfg.alpha,
      router_jitter_noise=moe_cfg.jitter,
    )

  def sliding_to_hf(self, cfg) -> dict:
    return {}  # sliding_window is one of `to_hf`'s fields


MIXTRAL = Mixtral(
  "mixtral",
  "MixtralForCausalLM",
  moe_module="block_sparse_moe",
  expert_names={"w_gate": "w1", "w_in": "w3", "w_out": "w2"},
)
