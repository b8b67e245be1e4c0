"""The dense sources of upcycling: Llama (`llama`) and Qwen3 (`qwen3`, with QK-norm): GQA with optional attention
biases and the dense SwiGLU FFN in every layer; `upcycle` makes Mixtral and Qwen3-MoE of them."""

import dataclasses

from moejax.models.families.base import Family


@dataclasses.dataclass(frozen=True)
class Dense(Family):
  attention_bias: bool = True

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (False,) * layers

  def moe_fields(self, hf: dict) -> dict:
    return {}  # no MoE layer reads them

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    return dict(attention_bias=cfg.qkv_bias)


LLAMA = Dense("llama", "LlamaForCausalLM", upcycled_as="mixtral")
QWEN3 = Dense("qwen3", "Qwen3ForCausalLM", qk_norm=True, upcycled_as="qwen3_moe")
