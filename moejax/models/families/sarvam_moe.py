"""Sarvam-MoE (`sarvam_moe`, sarvamai/sarvam-30b): GLM-4.5 (`families/glm4_moe.py`), as transformers runs it
(Glm4MoeForCausalLM): GQA with q, k, v biases (attention_bias, its alias use_qkv_bias; no output bias), QK-norm per
head before RoPE (use_qk_norm, default true), RoPE over the whole head (partial_rotary_factor 1 unless config.json
says), first_k_dense_replace dense layers, then DeepSeek-V3's MoE layers with shared experts.

Its checkpoints keep Sarvam's tensor names, which save_pretrained writes back (transformers' WeightRenaming of
sarvam_moe, reversed here by `renames`): `model.word_embeddings`, `attention.dense` (o_proj),
`attention.query_layernorm` / `key_layernorm` (q_norm, k_norm), `mlp.gate.expert_bias` (e_score_correction_bias),
and q, k and v fused by rows in `attention.query_key_value` [(H + 2 H_kv) W, d] (its bias likewise), read and
written as row parts (`hf_parts`). config.json may name num_experts, num_shared_experts and use_qkv_bias for
n_routed_experts, n_shared_experts and attention_bias (SarvamMoEConfig's aliases); what it leaves out is
SarvamMoEConfig's default (theta 8e6, QK-norm on, 2.5 routed scaling, ...).
"""

import dataclasses
import re

from moejax.models import hf_parts
from moejax.models.families.glm4_moe import GqaDeepSeekV3

# SarvamMoEConfig's attribute_map: config.json's names -> the fields transformers reads.
ALIASES = {
  "num_experts": "n_routed_experts",
  "num_shared_experts": "n_shared_experts",
  "use_qkv_bias": "attention_bias",
  "num_mtp_layers": "num_nextn_predict_layers",
}
# SarvamMoEConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {
  "use_qk_norm": True,
  "num_key_value_heads": 4,
  "head_dim": 64,
  "intermediate_size": 8192,
  "moe_intermediate_size": 1024,
  "num_experts_per_tok": 6,
  "n_routed_experts": 128,
  "n_shared_experts": 1,
  "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 1,
  "norm_topk_prob": True,
}
DEFAULT_THETA = 8_000_000.0
QKV = re.compile(r"\.self_attn\.([qkv])_proj\.(weight|bias)$")


def _read(hf: dict) -> dict:
  """config.json with its aliases under the names transformers reads and SarvamMoEConfig's defaults filled in."""
  return {**DEFAULTS, **{ALIASES[k]: v for k, v in hf.items() if k in ALIASES}, **hf}


@dataclasses.dataclass(frozen=True)
class SarvamMoe(GqaDeepSeekV3):
  def hf_name(self, name: str, cfg) -> str:
    fused = QKV.search(name)
    name = super().hf_name(name, cfg)
    if fused is None:
      return name
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    start = {"q": 0, "k": q, "v": q + kv}[fused[1]]
    return hf_parts.rows(name, start, start + (q if fused[1] == "q" else kv), q + 2 * kv)

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return super().moe_layers(_read(hf), layers)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    fields = {**super().decoder_fields(hf), "d_ff": hf["intermediate_size"]}
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    fields = super().moe_fields({**hf, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})  # V3's router always
    return {**fields, "num_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"]}

  def to_hf(self, cfg, moe_cfg) -> dict:
    # partial_rotary_factor always said, as save_pretrained does: GLM-4.5's class (which runs Sarvam) defaults to 0.5
    rope = {"rope_theta": cfg.rope_theta, **(cfg.scaling or {"rope_type": "default"})}
    rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return {**super().to_hf(cfg, moe_cfg), "rope_parameters": rope}


SARVAM_MOE = SarvamMoe(
  "sarvam_moe",
  "Glm4MoeForCausalLM",
  renames=(
    (r"^model\.embed_tokens\.", "model.word_embeddings."),
    (r"\.self_attn\.[qkv]_proj\.", ".self_attn.query_key_value."),
    (r"\.self_attn\.o_proj\.", ".self_attn.dense."),
    (r"\.self_attn\.q_norm\.", ".self_attn.query_layernorm."),
    (r"\.self_attn\.k_norm\.", ".self_attn.key_layernorm."),
    (r"\.self_attn\.", ".attention."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias"),
  ),
)
