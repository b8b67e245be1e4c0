"""GLM-5 (`glm_moe_dsa`, transformers' GlmMoeDsaForCausalLM): DeepSeek-V3.2's decoder (`deepseek_v32`: DeepSeek sparse
attention in every layer, DeepSeek-V3's MoE layers) whose indexer applies RoPE in interleaved pairs, as its MLA does,
with 32 indexer heads by default. Its per-layer indexer_types (else index_topk_pattern, else index_topk_freq and
index_skip_topk_offset, as GlmMoeDsaConfig derives them) may make a layer 'shared': it reuses the previous 'full'
layer's top-k instead of running an indexer; moejax runs each layer's own and refuses a 'shared' layer naming
indexer_types. The published MTP layer (`model.layers.78.*`) is ignored on load, as transformers ignores it.
"""

import dataclasses

from moejax.models.families.deepseek_v32 import DeepSeekV32
from moejax.validation import require


def indexer_types(hf: dict) -> list:
  """Per layer 'full' or 'shared', as GlmMoeDsaConfig derives them from config.json."""
  layers, pattern = hf["num_hidden_layers"], hf.get("index_topk_pattern")
  if hf.get("indexer_types"):
    return list(hf["indexer_types"])
  if pattern is not None:
    return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
  freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
  return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


@dataclasses.dataclass(frozen=True)
class GlmMoeDsa(DeepSeekV32):
  index_heads: int = 32
  index_rope_interleaved: bool = True

  def decoder_fields(self, hf: dict) -> dict:
    kinds = indexer_types(hf)
    why = f"{hf['num_hidden_layers']} x 'full' (a 'shared' layer reuses an earlier layer's top-k: not supported)"
    require(kinds == ["full"] * hf["num_hidden_layers"], "indexer_types", kinds, why)
    return super().decoder_fields(hf)

  def to_hf(self, cfg, moe_cfg) -> dict:
    return {**super().to_hf(cfg, moe_cfg), "indexer_types": ["full"] * cfg.num_layers}


GLM_MOE_DSA = GlmMoeDsa("glm_moe_dsa", "GlmMoeDsaForCausalLM", ignored=(r"^model\.layers\.78\.",))
