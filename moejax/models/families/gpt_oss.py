"""gpt-oss (`gpt_oss`): GQA with q, k, v and output biases (attention_bias) and a learned sink logit per head
(`self_attn.sinks`), sliding_attention and full_attention layers alternating (layer_types), YaRN RoPE (truncate
false); every FFN the MoE layer: a linear router with a bias (`mlp.router`), the top k of its logits softmaxed over the
k (= softmax renormalised over them), experts with biases and the clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7).

Its experts are stored stacked, not one tensor per expert, and [E, in, out] as moejax holds them:
`mlp.experts.gate_up_proj` [E, d, 2f] with the gate and up projections interleaved (gate = [..., 0::2], up =
[..., 1::2]), `gate_up_proj_bias` [E, 2f] likewise, `down_proj` [E, f, d], `down_proj_bias` [E, d]; the published
checkpoints hold gate_up_proj and down_proj in MXFP4 (`hf_files`), read as the same tensors.
"""

import dataclasses

from moejax.models import hf_parts
from moejax.models.families.base import Family, moe_indices
from moejax.validation import require

# moejax's expert parameters -> (stored tensor under mlp.experts, its part: columns i::2 of the last axis, or None)
EXPERT_TENSORS = {
  "w_gate": ("gate_up_proj", 0),
  "w_in": ("gate_up_proj", 1),
  "w_out": ("down_proj", None),
  "b_gate": ("gate_up_proj_bias", 0),
  "b_in": ("gate_up_proj_bias", 1),
  "b_out": ("down_proj_bias", None),
}


@dataclasses.dataclass(frozen=True)
class GptOss(Family):
  attention_bias: bool = True

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path[0] == "router":  # mlp.router.weight [E, d] (a torch Linear), mlp.router.bias [E]
      return f"{container}.router.{'weight' if path[1] == 'kernel' else path[1]}", path[1] == "kernel"
    if path[0] not in EXPERT_TENSORS:
      return None
    tensor, part = EXPERT_TENSORS[path[0]]
    name = f"{container}.experts.{tensor}"
    return (name if part is None else hf_parts.columns(name, part, 2)), False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def decoder_fields(self, hf: dict) -> dict:
    return {**super().decoder_fields(hf), "attention_sinks": True}

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["intermediate_size"],
      renormalize=True,
      activation="swiglu_clamped",
      swiglu_alpha=hf.get("swiglu_alpha", 1.702),
      swiglu_limit=hf.get("swiglu_limit", 7.0),
      ffn_bias=True,
      router_bias=True,
      load_balance_coef=hf.get("router_aux_loss_coef", 0.9),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg)
    require(
      len(moe_indices(cfg)) == cfg.num_layers, "moe_layers", cfg.moe_layers, "all True (gpt-oss has no dense layers)"
    )
    for name, got, want in (
      ("moe.activation", moe_cfg.activation, "swiglu_clamped"),
      ("moe.ffn_bias", moe_cfg.ffn_bias, True),
      ("moe.router_bias", moe_cfg.router_bias, True),
      ("moe.renormalize", moe_cfg.renormalize, True),
      ("attention_sinks", cfg.attention_sinks, True),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
    ):
      require(got == want, name, got, f"{want!r}: gpt-oss's config.json cannot say otherwise")
    require(
      moe_cfg.d_ff == cfg.d_ff, "moe.d_ff", moe_cfg.d_ff, f"the decoder's d_ff={cfg.d_ff} (one intermediate_size)"
    )
    return dict(
      num_local_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      swiglu_alpha=moe_cfg.swiglu_alpha,
      swiglu_limit=moe_cfg.swiglu_limit,
      attention_bias=cfg.qkv_bias,
      router_aux_loss_coef=moe_cfg.alpha,
    )


GPT_OSS = GptOss("gpt_oss", "GptOssForCausalLM")
