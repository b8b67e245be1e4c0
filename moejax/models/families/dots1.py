"""dots.llm1 (`dots1`, rednote): Qwen3's attention (GQA with QK-norm always, an explicit head_dim; attention_bias puts
biases on q, k, v and o) with DeepSeek-V3's MoE layers (first_k_dense_replace dense layers, then sigmoid routing with
the e_score_correction_bias, groups by their two best, norm_topk_prob, x routed_scaling_factor, shared experts). It
differs from GLM-4.5 (`glm4_moe`) by flags: QK-norm always, o_proj biased with the rest, no MTP, no partial RoPE field
(the shared `rope_parameters` reader takes it if present), and by its sliding rule: without layer_types the layers
from max_window_layers (default 62) on slide when sliding_window is set (transformers' Dots1Config)."""

import dataclasses

from moejax.models.families.glm4_moe import GqaDeepSeekV3


@dataclasses.dataclass(frozen=True)
class Dots1(GqaDeepSeekV3):
  qk_norm: bool = True
  qk_norm_field: str | None = None
  out_bias: bool = True
  mtp: bool = False

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    if hf.get("layer_types") or hf.get("sliding_window") is None:
      return super().sliding(hf, layers)
    kinds = tuple(i >= hf.get("max_window_layers", 62) for i in range(layers))
    return (hf["sliding_window"], kinds) if any(kinds) else (None, None)

  def sliding_to_hf(self, cfg) -> dict:
    # Dots1Config's defaults (sliding_window 4096 from layer 62 on) would otherwise make a window of their own.
    return super().sliding_to_hf(cfg) or dict(sliding_window=None, layer_types=["full_attention"] * cfg.num_layers)


DOTS1 = Dots1("dots1", "Dots1ForCausalLM")
