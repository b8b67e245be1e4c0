"""Qwen3-MoE (`qwen3_moe`): Qwen2-MoE's MoE layers without the shared expert; GQA with QK-norm (RMSNorm per head
before RoPE), an explicit head_dim and optional attention biases."""

import dataclasses

from moejax.models.families.qwen2_moe import QwenMoe


@dataclasses.dataclass(frozen=True)
class Qwen3Moe(QwenMoe):
  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    return {**self.moe_to_hf(cfg, moe_cfg), "attention_bias": cfg.qkv_bias}


QWEN3_MOE = Qwen3Moe("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, attention_bias=True)
