"""DeepSeek-V2 (`deepseek_v2`) and DeepSeek-V3 (`deepseek_v3`): multi-head latent attention (MLA: q through an
optional low-rank latent, keys and values from a compressed latent, a rotary key shared by the heads, YaRN),
first_k_dense_replace dense layers then MoE layers with shared experts (`mlp.shared_experts`).

Routing: V2 softmax, `greedy` or `group_limited_greedy` (groups by their best score); V3 sigmoid with the
loss-free balancing bias (`mlp.gate.e_score_correction_bias`) for the choice, groups by their two best (`noaux_tc`);
both x routed_scaling_factor. V3 adds interleaved rotary pairs as a config.json field and the MTP modules.
"""

import dataclasses

from moejax.models.families.base import Family, moe_indices
from moejax.validation import require

LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# DeepSeek-V3's loss-free balancing bias moves at the paper's 0.001 per step (Sec. 4.2) unless the caller says.
V3_BIAS_RATE = 0.001


@dataclasses.dataclass(frozen=True)
class DeepSeekV2(Family):
  """topk_method, scoring_func: the defaults of a config.json that leaves them out."""

  latent: bool = True
  topk_method: str = "greedy"
  scoring_func: str = "softmax"

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return tuple(i >= hf.get("first_k_dense_replace", 0) for i in range(layers))

  def decoder_fields(self, hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    return {
      **super().decoder_fields(hf),
      **{k: hf[k] for k in LATENT_FIELDS},
      "num_kv_heads": heads,
      "head_dim": hf.get("qk_rope_head_dim") or hf["hidden_size"] // heads,
      "rope_interleaved": True,
    }

  def moe_fields(self, hf: dict) -> dict:
    method = hf.get("topk_method", self.topk_method)
    groups = hf.get("n_group") if method in ("group_limited_greedy", "noaux_tc") else None
    scoring = hf.get("scoring_func", self.scoring_func)
    require(scoring in ("softmax", "sigmoid"), "scoring_func", scoring, "'softmax' or 'sigmoid'")
    fields = dict(
      d_ff=hf["moe_intermediate_size"],
      score=scoring,
      renormalize=bool(hf.get("norm_topk_prob", False)),
      routed_scaling=hf.get("routed_scaling_factor", 1.0),
      group_score="max" if method == "group_limited_greedy" else "top2_sum",
    )
    if groups and groups > 1:
      fields.update(num_groups=groups, topk_groups=hf["topk_group"])
    if hf.get("n_shared_experts"):
      fields.update(num_shared_experts=hf["n_shared_experts"], shared_d_ff=hf["moe_intermediate_size"])
    return {**fields, **self.balance_fields(hf)}

  def balance_fields(self, hf: dict) -> dict:
    """How the routed layer is balanced in training: V2's auxiliary loss."""
    return dict(load_balance_coef=hf.get("aux_loss_alpha", 0.001))

  def to_hf(self, cfg, moe_cfg) -> dict:
    return {
      **{k: getattr(cfg, k) for k in LATENT_FIELDS},
      **self.routed_to_hf(cfg, moe_cfg),
      "scoring_func": moe_cfg.score,
      **self.version_to_hf(cfg, moe_cfg),
    }

  def routed_to_hf(self, cfg, moe_cfg) -> dict:
    """The dense layers first, the routed experts, their groups and the shared experts (DeepSeek's fields, which
    GLM-4.5 shares)."""
    groups = moe_cfg.num_groups or 1
    return dict(
      **self.layers_to_hf(cfg),
      n_routed_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      n_shared_experts=moe_cfg.num_shared_experts,
      routed_scaling_factor=moe_cfg.routed_scaling,
      norm_topk_prob=moe_cfg.renormalize,
      n_group=groups,
      topk_group=moe_cfg.topk_groups if moe_cfg.num_groups else 1,
    )

  def layers_to_hf(self, cfg) -> dict:
    """Which layers are MoE: first_k_dense_replace dense layers, then MoE layers (refused otherwise)."""
    moe_at = moe_indices(cfg)
    first_moe = moe_at[0] if moe_at else cfg.num_layers
    require(
      moe_at == list(range(first_moe, cfg.num_layers)),
      "moe_layers",
      cfg.moe_layers,
      f"dense layers first, then MoE layers ({cfg.family}'s first_k_dense_replace)",
    )
    return dict(first_k_dense_replace=first_moe)

  def version_to_hf(self, cfg, moe_cfg) -> dict:
    """What V2 and V3 write differently: V2's topk_method says whether groups limit the choice."""
    return dict(topk_method="group_limited_greedy" if moe_cfg.num_groups else "greedy")


@dataclasses.dataclass(frozen=True)
class DeepSeekV3(DeepSeekV2):
  topk_method: str = "noaux_tc"
  scoring_func: str = "sigmoid"

  def decoder_fields(self, hf: dict) -> dict:
    return {
      **super().decoder_fields(hf),
      "rope_interleaved": hf.get("rope_interleave", True),
      "num_mtp_layers": hf.get("num_nextn_predict_layers", 0),
    }

  def balance_fields(self, hf: dict) -> dict:
    """The sequence-wise balance loss and the loss-free bias, as V3 trains (Sec. 2.1.2, 4.2)."""
    return dict(bias_update_rate=V3_BIAS_RATE, balance_loss="sequence", load_balance_coef=0.0001)

  def require_v3_router(self, cfg, moe_cfg) -> None:
    """For the families whose config.json names no scoring_func nor topk_method (GLM-4.5, dots1, GLM-4.7-Flash):
    the router is V3's, sigmoid scores and groups by their two best, or refused by the MoEConfig field."""
    if cfg.num_moe_layers:
      for name, want in (
        ("score", "sigmoid"),
        ("group_score", "top2_sum" if moe_cfg.num_groups else moe_cfg.group_score),
      ):
        got = getattr(moe_cfg, name)
        require(got == want, f"moe.{name}", got, f"{want!r} ({cfg.family}'s config.json cannot say otherwise)")

  def version_to_hf(self, cfg, moe_cfg) -> dict:
    return dict(
      topk_method="noaux_tc", rope_interleave=cfg.rope_interleaved, num_nextn_predict_layers=cfg.num_mtp_layers
    )


DEEPSEEK_V2 = DeepSeekV2("deepseek_v2", "DeepseekV2ForCausalLM")
DEEPSEEK_V3 = DeepSeekV3("deepseek_v3", "DeepseekV3ForCausalLM")
