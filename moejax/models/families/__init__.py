"""The decoder families, one module each (`base.Family` is the interface), registered here by `model_type`.

A new family: its module (a `Family` subclass and its instance) and one line below; its fixture in
tests/fixtures/make_hf_fixtures.py. The MoE families of transformers that moejax cannot run are in UNSUPPORTED,
each with the feature it lacks, so that loading one is refused by that reason (`hf_config.from_hf_config`).
"""

from moejax.models.families import (
  deepseek,
  deepseek_v32,
  dense,
  dots1,
  ernie4_5_moe,
  glm4_moe,
  glm4_moe_lite,
  glm_moe_dsa,
  gpt_oss,
  hunyuan_v1_moe,
  hy_v3,
  kimi_k25,
  kimi_linear,
  llama4,
  longcat_flash,
  mellum,
  mimo_v2_flash,
  minimax_m2,
  mixtral,
  olmoe,
  qwen2_moe,
  qwen3_5_moe,
  qwen3_moe,
  qwen3_next,
  sarvam_mla,
  sarvam_moe,
  solar_open,
)
from moejax.models.families.base import Family

# The families, in the order errors list them.
FAMILIES: tuple[Family, ...] = (
  mixtral.MIXTRAL,
  qwen2_moe.QWEN2_MOE,
  qwen3_moe.QWEN3_MOE,
  deepseek.DEEPSEEK_V2,
  deepseek.DEEPSEEK_V3,
  glm4_moe.GLM4_MOE,
  glm4_moe_lite.GLM4_MOE_LITE,
  dots1.DOTS1,
  gpt_oss.GPT_OSS,
  olmoe.OLMOE,
  minimax_m2.MINIMAX_M2,
  solar_open.SOLAR_OPEN,
  hunyuan_v1_moe.HUNYUAN_V1_MOE,
  sarvam_moe.SARVAM_MOE,
  qwen3_next.QWEN3_NEXT,
  qwen3_5_moe.QWEN3_5_MOE,
  qwen3_5_moe.QWEN3_5_MOE_TEXT,
  kimi_k25.KIMI_K25,
  kimi_linear.KIMI_LINEAR,
  ernie4_5_moe.ERNIE4_5_MOE,
  mimo_v2_flash.MIMO_V2_FLASH,
  llama4.LLAMA4_TEXT,
  llama4.LLAMA4,
  longcat_flash.LONGCAT_FLASH,
  deepseek_v32.DEEPSEEK_V32,
  glm_moe_dsa.GLM_MOE_DSA,
  sarvam_mla.SARVAM_MLA,
  hy_v3.HY_V3,
  mellum.MELLUM,
  dense.LLAMA,
  dense.QWEN3,
)
REGISTRY: dict[str, Family] = {family.model_type: family for family in FAMILIES}  # by model_type

# transformers 5.24's MoE model_types (issue 59) that moejax does not load, by what moejax lacks to run them.
UNSUPPORTED: dict[str, str] = {
  "deepseek_v4": "compressed sparse attention (KV compressors and an indexer over the cache) not supported",
}


def get(model_type: str) -> Family:
  """The family of a `DecoderConfig.family` (checked there, so a KeyError here is a bug)."""
  return REGISTRY[model_type]
