"""Sarvam-MLA (`sarvam_mla`, Sarvam AI's sarvam-105b): DeepSeek-V3's decoder under its own model_type, which
transformers runs as DeepseekV3ForCausalLM (the architecture config.json names): MLA, interleaved rotary pairs, YaRN,
first_k_dense_replace dense layers, sigmoid routing with the e_score_correction_bias, x routed_scaling_factor, shared
experts; checkpoint keys as DeepSeek-V3's (`families/deepseek.py`).

What SarvamMLAConfig says its own way: its defaults where config.json is silent (no q LoRA, one group, one dense
layer), the original config.json's names (num_experts, num_shared_experts, num_local_experts, num_mtp_layers)
for DeepSeek-V3's, and that format's rope_scaling type 'deepseek_yarn' (YaRN) and head_dim (kv_lora_rank +
qk_rope_head_dim, for vLLM), which the config drops, as `decoder_config` does here.
"""

import dataclasses

from moejax.models.families.deepseek import DeepSeekV3

# SarvamMLAConfig's values of the fields a config.json may leave out, where they differ from DeepseekV3Config's.
DEFAULTS = {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
# SarvamMLAConfig's attribute_map: config.json's names -> DeepSeek-V3's.
ALIASES = {
  "num_local_experts": "n_routed_experts",
  "num_experts": "n_routed_experts",
  "num_shared_experts": "n_shared_experts",
  "num_mtp_layers": "num_nextn_predict_layers",
}


@dataclasses.dataclass(frozen=True)
class SarvamMla(DeepSeekV3):
  def decoder_config(self, hf: dict) -> dict:
    """config.json as DeepSeek-V3's: SarvamMLAConfig's defaults, its aliases under DeepSeek-V3's names, the original
    format's head_dim and q_head_dim dropped and its 'deepseek_yarn' rope_scaling read as YaRN."""
    hf = {**DEFAULTS, **{ALIASES[k]: v for k, v in hf.items() if k in ALIASES}, **hf}
    hf = {k: v for k, v in hf.items() if k not in ALIASES}
    for derived in ("head_dim", "q_head_dim"):
      hf.pop(derived, None)
    scaling = hf.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
      hf["rope_scaling"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}
    return hf

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_v3_router(cfg, moe_cfg)  # DeepseekV3ForCausalLM's router is sigmoid whatever scoring_func says
    return super().to_hf(cfg, moe_cfg)


SARVAM_MLA = SarvamMla("sarvam_mla", "DeepseekV3ForCausalLM")
