"""Qwen3-Next (`qwen3_next`): layers of two token mixers by layer_types (or every full_attention_interval-th layer
attention, transformers' default 4): gated DeltaNet layers (`linear_attn`, `moejax.models.linear_attention`;
config.json's linear_* fields) and gated attention (`self_attn`: q_proj emits per head [query | gate], the output
times sigmoid(gate) before o_proj; per-head QK-norm before RoPE; partial RoPE over the first head_dim x
partial_rotary_factor dimensions, 0.25 where config.json says none); every block RMSNorm x (1 + weight); the MoE
layers Qwen2-MoE's (softmax top-k, norm_topk_prob, one shared expert scaled by sigmoid(shared_expert_gate(x))).

The published checkpoints' MTP module (`mtp.*`) is ignored by transformers' Qwen3NextForCausalLM, and by moejax
(`Family.ignored`); an export has none.
"""

import dataclasses

from moejax.models.families.qwen2_moe import Qwen2Moe
from moejax.validation import require

# Qwen3NextConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {
  "head_dim": 256,
  "norm_topk_prob": True,
  "linear_num_key_heads": 16,
  "linear_num_value_heads": 32,
  "linear_key_head_dim": 128,
  "linear_value_head_dim": 128,
  "linear_conv_kernel_dim": 4,
}
KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}  # layer_types -> DecoderConfig.mixers
LINEAR = {  # config.json -> DecoderConfig
  "linear_num_key_heads": "linear_num_key_heads",
  "linear_num_value_heads": "linear_num_value_heads",
  "linear_key_head_dim": "linear_key_head_dim",
  "linear_value_head_dim": "linear_value_head_dim",
  "linear_conv_kernel_dim": "linear_conv_kernel",
}


def layer_mixers(hf: dict, layers: int) -> tuple:
  """Per layer its mixer from layer_types, else attention every full_attention_interval-th layer (default 4)."""
  types = hf.get("layer_types")
  if not types:
    every = hf.get("full_attention_interval", 4)
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
  unknown = sorted(set(types) - set(KINDS))
  require(not unknown and len(types) == layers, "layer_types", types, f"{layers} of {sorted(KINDS)}")
  return tuple(KINDS[kind] for kind in types)


@dataclasses.dataclass(frozen=True)
class Qwen3Next(Qwen2Moe):
  """split_projections: the gated DeltaNet's input projections apart (`DecoderConfig.linear_split_projections`:
  Qwen3.5-MoE's layout) rather than grouped per key head."""

  qk_norm: bool = True
  attention_bias: bool = True
  hybrid: bool = True
  split_projections: bool = False

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # layer_types names mixers here, and transformers' attention has no window

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    rope = hf.get("rope_parameters") or {}
    bias = bool(hf.get("attention_bias"))
    return dict(
      super(Qwen2Moe, self).decoder_fields(hf),  # Family's GQA heads and width (not Qwen2-MoE's qkv_bias field)
      qkv_bias=bias,
      out_bias=bias,
      partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
      mixers=layer_mixers(hf, hf["num_hidden_layers"]),
      gated_attention=True,
      norm_offset=True,
      linear_split_projections=self.split_projections,
      **{ours: hf[theirs] for theirs, ours in LINEAR.items()},
    )

  def moe_fields(self, hf: dict) -> dict:
    return super().moe_fields({**DEFAULTS, **hf})

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, got, want in (
      ("qk_norm", cfg.qk_norm, True),
      ("qk_norm_mode", cfg.qk_norm_mode, "head"),
      ("gated_attention", cfg.gated_attention, True),
      ("norm_offset", cfg.norm_offset, True),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
      ("moe.shared_gate", moe_cfg.shared_gate, True),
      ("sliding_window", cfg.sliding_window, None),
      ("attention_sinks", cfg.attention_sinks, False),
      ("clip_qkv", cfg.clip_qkv, None),
      ("rope_interleaved", cfg.rope_interleaved, False),
      ("linear_split_projections", cfg.linear_split_projections, self.split_projections),
    ):
      require(got == want, name, got, f"{want!r}: {cfg.family}'s config.json cannot say otherwise")
    self.require_plain_router(cfg, moe_cfg, shared_experts=1)  # transformers' MoE block always has one
    kinds = {mixer: kind for kind, mixer in KINDS.items()}
    return {
      **self.moe_to_hf(cfg, moe_cfg),
      "shared_expert_intermediate_size": moe_cfg.shared_width,
      "attention_bias": cfg.qkv_bias,
      "layer_types": [kinds[cfg.mixer(i)] for i in range(cfg.num_layers)],
      **{theirs: getattr(cfg, ours) for theirs, ours in LINEAR.items()},
      # written even when 1: a config.json without it means 0.25
      "rope_parameters": {
        "rope_theta": cfg.rope_theta,
        **(cfg.scaling or {"rope_type": "default"}),
        "partial_rotary_factor": cfg.partial_rotary_factor,
      },
    }


QWEN3_NEXT = Qwen3Next("qwen3_next", "Qwen3NextForCausalLM", shared_module="shared_expert", ignored=(r"^mtp\.",))
