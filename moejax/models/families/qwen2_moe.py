"""Qwen2-MoE (`qwen2_moe`): GQA with q, k, v biases; MoE layers every decoder_sparse_step-th layer but those of
mlp_only_layers (dense SwiGLU), softmax top-k (renormalised with norm_topk_prob), plus one shared expert gated by
sigmoid(x w) (`mlp.shared_expert`, `mlp.shared_expert_gate`). `QwenMoe` is what Qwen3-MoE shares."""

import dataclasses

from moejax.models.families.base import Family, num_experts


@dataclasses.dataclass(frozen=True)
class QwenMoe(Family):
  """The MoE layers of Qwen2-MoE and Qwen3-MoE: where they are, their routing, their config.json fields."""

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    skip, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    return tuple(i not in skip and num_experts(hf) > 0 and (i + 1) % step == 0 for i in range(layers))

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["moe_intermediate_size"],
      renormalize=bool(hf.get("norm_topk_prob", False)),
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )

  def moe_to_hf(self, cfg, moe_cfg) -> dict:
    return dict(
      num_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      norm_topk_prob=moe_cfg.renormalize,
      decoder_sparse_step=1,
      router_aux_loss_coef=moe_cfg.alpha,
      mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe(i)],
    )


@dataclasses.dataclass(frozen=True)
class Qwen2Moe(QwenMoe):
  def decoder_fields(self, hf: dict) -> dict:
    return {**super().decoder_fields(hf), "qkv_bias": hf.get("qkv_bias", True), "out_bias": False}

  def moe_fields(self, hf: dict) -> dict:
    fields = super().moe_fields(hf)
    if hf.get("shared_expert_intermediate_size"):
      fields.update(num_shared_experts=1, shared_d_ff=hf["shared_expert_intermediate_size"], shared_gate=True)
    return fields

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg, shared_experts=1)
    return {
      **self.moe_to_hf(cfg, moe_cfg),
      "qkv_bias": cfg.qkv_bias,
      "shared_expert_intermediate_size": moe_cfg.shared_width,
    }


QWEN2_MOE = Qwen2Moe("qwen2_moe", "Qwen2MoeForCausalLM", shared_module="shared_expert")
