"""Qwen3-VL-MoE (`qwen3_vl_moe`, transformers' Qwen3VLMoeForConditionalGeneration): a vision tower (`model.visual.*`)
before Qwen3-MoE's decoder (`model.language_model.*`, config.json's decoder fields under text_config;
`vision_language`), run on text-only input. The decoder is Qwen3-MoE's (GQA with per-head QK-norm, MoE layers by
decoder_sparse_step and mlp_only_layers, no shared expert) with:

  - the router always renormalising its top k (Qwen3VLMoeTextTopKRouter; config.json has no norm_topk_prob);
  - the experts stacked: `mlp.experts.gate_up_proj` (the gate projections, then the up ones) and `down_proj`, in the
    hub's layout [E, d, 2f] and [E, f, d] or, as transformers 5's save_pretrained writes its modules', [E, 2f, d] and
    [E, d, f] (`hf_parts.experts`: either is read, as transformers' loader reads either);
  - interleaved multimodal RoPE (rope_parameters' mrope_section) over the whole head: on text-only input
    transformers gives the temporal, height and width positions the token's index, so every frequency turns by the
    same position, which is Qwen3-MoE's plain RoPE; mrope_section is unread. Without pixel values no deepstack
    features are added to the early layers.

Qwen3VLMoeTextConfig's default RoPE theta is 500000 where config.json names none. `to_hf` writes the decoder as
`qwen3_moe` (Qwen3MoeForCausalLM with norm_topk_prob true: the same forward on text).
"""

import dataclasses

from moejax.models.families import vision_language
from moejax.models.families.base import fused_expert_key
from moejax.models.families.qwen3_moe import Qwen3Moe

MROPE = ("mrope_section", "mrope_interleaved")  # rope_parameters' multimodal fields: text-only positions make them moot
DEFAULT_THETA = 500_000.0


@dataclasses.dataclass(frozen=True)
class Qwen3VLMoe(Qwen3Moe):
  exports_as: str | None = "qwen3_moe"

  def decoder_config(self, hf: dict) -> dict:
    hf = vision_language.decoder_config(hf, self.model_type, tied=False)  # Qwen3VLMoeConfig's default
    rope = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in MROPE}
    if "rope_theta" not in rope and "rope_theta" not in hf:
      rope.update(rope_type=rope.get("rope_type", "default"), rope_theta=DEFAULT_THETA)
    return {**hf, "rope_parameters": rope}

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    experts = f"{container}.experts"  # the router: mlp.gate.weight, as Qwen3-MoE's
    return fused_expert_key(path, f"{experts}.gate_up_proj", f"{experts}.down_proj")

  def moe_fields(self, hf: dict) -> dict:
    return {**super().moe_fields(hf), "renormalize": True}


QWEN3_VL_MOE = Qwen3VLMoe(
  "qwen3_vl_moe",
  "Qwen3VLMoeForConditionalGeneration",
  qk_norm=True,
  attention_bias=True,
  renames=((r"^model\.", "model.language_model."),),
  ignored=(r"^model\.visual\.",),
)
