"""Kimi Linear (`kimi_linear`): layers of two token mixers by layer_types, both under `self_attn`: Kimi delta
attention (KDA: the gated DeltaNet's rule with a decay per key channel, `moejax.models.kimi_delta_attention`; config.json's
linear_num_heads, linear_head_dim, linear_conv_kernel_dim, or the published linear_attn_config) and DeepSeek's MLA
without RoPE (NoPE: the key's qk_rope_head_dim part is still one per token shared by the heads, but not rotated; scale
(qk_nope_head_dim + qk_rope_head_dim)^-0.5); the MoE layers by mlp_layer_types (or after first_k_dense_replace dense
ones) with DeepSeek-V3's router (sigmoid, the e_score_correction_bias, groups by their two best) and shared experts.

transformers' KimiLinearConfig stores DeepSeek-V3's routing fields under its attribute_map's names (num_experts,
num_experts_per_token, num_expert_group, num_shared_experts, moe_renormalize, model_max_length); the checkpoint keeps the
published names, which transformers' conversion renames on load and back on save: every FFN, dense or MoE, under
`block_sparse_moe`, the experts' w1, w3, w2 (gate, up, down), the convolution as q_conv1d, k_conv1d, v_conv1d.
"""

import dataclasses

from moejax.models.families.glm4_moe_lite import Glm4MoeLite
from moejax.validation import require

# KimiLinearConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {
  "n_group": 1,
  "topk_group": 1,
  "norm_topk_prob": True,
  "n_shared_experts": 1,
  "routed_scaling_factor": 2.446,
  "q_lora_rank": None,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "num_experts_per_tok": 8,
  "rms_norm_eps": 1e-5,
  "max_position_embeddings": 1048576,
  "linear_num_heads": 32,
  "linear_head_dim": 128,
  "linear_conv_kernel_dim": 4,
}
# config.json's names (KimiLinearConfig.attribute_map's targets) -> the DeepSeek-V3 names moejax's readers use
NAMES = {
  "num_experts_per_token": "num_experts_per_tok",
  "num_expert_group": "n_group",
  "num_shared_experts": "n_shared_experts",
  "moe_renormalize": "norm_topk_prob",
  "model_max_length": "max_position_embeddings",
}
LINEAR = {
  "num_heads": "linear_num_heads",
  "head_dim": "linear_head_dim",
  "short_conv_kernel_size": "linear_conv_kernel_dim",
}
PAD_TOKEN = 163839  # KimiLinearConfig's default pad_token_id, the embedding's padding_idx in transformers
KINDS = {"linear_attention": "kimi_delta", "full_attention": "attention"}  # layer_types -> DecoderConfig.mixers
LATENT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def layer_types(hf: dict, layers: int) -> list:
  """layer_types; else the published linear_attn_config's full_attn_layers and kda_layers (1-indexed); else
  KimiLinearConfig's default, attention at every layer i > 0 with i % 4 == 0."""
  sub = hf.get("linear_attn_config") or {}
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  if "full_attn_layers" in sub and "kda_layers" in sub:
    full = {i - 1 for i in sub["full_attn_layers"]}
    return ["full_attention" if i in full else "linear_attention" for i in range(layers)]
  return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


@dataclasses.dataclass(frozen=True)
class KimiLinear(Glm4MoeLite):
  hybrid: bool = True

  def decoder_config(self, hf: dict) -> dict:
    """config.json with its attribute_map's names as DeepSeek-V3's, the published linear_attn_config's sizes as
    transformers' linear_* fields, and KimiLinearConfig's defaults where it says nothing."""
    sub = hf.get("linear_attn_config") or {}
    return {
      **DEFAULTS,
      **{k: v for k, v in hf.items() if k not in NAMES},
      **{ours: hf[theirs] for theirs, ours in NAMES.items() if theirs in hf},
      **{ours: sub[theirs] for theirs, ours in LINEAR.items() if theirs in sub},
    }

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    if hf.get("mlp_layer_types"):
      return super().moe_layers(hf, layers)
    return tuple(i >= hf.get("first_k_dense_replace", 1) for i in range(layers))

  def decoder_fields(self, hf: dict) -> dict:
    layers, heads, width = hf["num_hidden_layers"], hf["linear_num_heads"], hf["linear_head_dim"]
    kinds = layer_types(hf, layers)
    unknown = sorted(set(kinds) - set(KINDS))
    require(not unknown and len(kinds) == layers, "layer_types", kinds, f"{layers} of {sorted(KINDS)}")
    return dict(
      super().decoder_fields(hf),
      rope_interleaved=False,  # no RoPE: nothing rotates
      num_mtp_layers=0,
      nope_layers=(True,) * layers,
      mixers=tuple(KINDS[kind] for kind in kinds),
      linear_num_key_heads=heads,
      linear_num_value_heads=heads,
      linear_key_head_dim=width,
      linear_value_head_dim=width,
      linear_conv_kernel=hf["linear_conv_kernel_dim"],
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, got, want in (
      ("nope_layers", cfg.nope_layers, (True,) * cfg.num_layers),
      ("mixers", set(cfg.mixers or ("attention",)) <= set(KINDS.values()), True),
      ("gated_attention", cfg.gated_attention, False),
      ("norm_offset", cfg.norm_offset, False),
      ("num_mtp_layers", cfg.num_mtp_layers, 0),
      ("sliding_window", cfg.sliding_window, None),
    ):
      require(got == want, name, getattr(cfg, name), f"{want!r}: {cfg.family}'s config.json cannot say otherwise")
    self.require_v3_router(cfg, moe_cfg)
    kinds = {mixer: kind for kind, mixer in KINDS.items()}
    return {
      **{k: getattr(cfg, k) for k in LATENT},
      **self.layers_to_hf(cfg),
      "num_experts": moe_cfg.num_experts,
      "num_experts_per_token": moe_cfg.top_k,
      "moe_intermediate_size": moe_cfg.d_ff,
      "num_shared_experts": moe_cfg.num_shared_experts,
      "routed_scaling_factor": moe_cfg.routed_scaling,
      "moe_renormalize": moe_cfg.renormalize,
      "num_expert_group": moe_cfg.num_groups or 1,
      "topk_group": moe_cfg.topk_groups if moe_cfg.num_groups else 1,
      "model_max_length": cfg.max_len,
      "layer_types": [kinds[cfg.mixer(i)] for i in range(cfg.num_layers)],
      "linear_num_heads": cfg.linear_num_value_heads,
      "linear_head_dim": cfg.linear_value_head_dim,
      "linear_conv_kernel_dim": cfg.linear_conv_kernel,
      # no token ids are kept; the default pad id past a smaller vocabulary would fail transformers' nn.Embedding
      **({} if cfg.vocab_size > PAD_TOKEN else {"pad_token_id": None}),
    }


KIMI_LINEAR = KimiLinear(
  "kimi_linear",
  "KimiLinearForCausalLM",
  expert_names={"w_gate": "w1", "w_in": "w3", "w_out": "w2"},
  renames=((r"\.mlp\.", ".block_sparse_moe."),),
)
