"""GLM-5 (`glm_moe_dsa`, transformers' GlmMoeDsaForCausalLM): DeepSeek-V3.2's decoder (`deepseek_v32`: DeepSeek sparse
attention in every layer, DeepSeek-V3's MoE layers) whose indexer applies RoPE in interleaved pairs, as its MLA does,
with 32 indexer heads by default. Its per-layer indexer_types (else index_topk_pattern, else index_topk_freq and
index_skip_topk_offset, as GlmMoeDsaConfig derives them) may make a layer 'shared': it has no indexer and reuses the
previous 'full' layer's top-k (transformers' prev_topk_indices), moejax's 'dsa_shared' mixer
(`moejax.models.sparse_attention`). The first layer must be 'full' (transformers fails at run time otherwise). The
published MTP layer (`model.layers.78.*`) is ignored on load, as transformers ignores it.
"""

import dataclasses

from moejax.models.families.deepseek_v32 import DeepSeekV32
from moejax.validation import require

MIXERS = {"full": "dsa", "shared": "dsa_shared"}  # indexer_types' entries as `DecoderConfig.mixers`


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
    kinds, layers = indexer_types(hf), hf["num_hidden_layers"]
    require(
      len(kinds) == layers and set(kinds) <= set(MIXERS) and kinds[0] == "full",
      "indexer_types",
      kinds,
      f"{layers} of 'full' or 'shared', the first 'full' (a 'shared' layer reuses the previous full layer's top-k)",
    )
    return {**super().decoder_fields(hf), "mixers": tuple(MIXERS[k] for k in kinds)}

  def layer_mixers(self, cfg) -> tuple:
    """'dsa' or 'dsa_shared' as cfg's layers have them (config.json's indexer_types)."""
    return tuple(m if m == MIXERS["shared"] else "dsa" for m in cfg.mixers or ("dsa",) * cfg.num_layers)

  def to_hf(self, cfg, moe_cfg) -> dict:
    kinds = {mixer: kind for kind, mixer in MIXERS.items()}
    return {**super().to_hf(cfg, moe_cfg), "indexer_types": [kinds[m] for m in self.layer_mixers(cfg)]}


GLM_MOE_DSA = GlmMoeDsa("glm_moe_dsa", "GlmMoeDsaForCausalLM", ignored=(r"^model\.layers\.78\.",))
