"""The decoder families, one module each (`base.Family` is the interface), registered here by `model_type`.

A new family: its module (a `Family` subclass and its instance) and one line below; its fixture in
tests/fixtures/make_hf_fixtures.py.
"""

from moejax.models.families import deepseek, dense, glm4_moe, gpt_oss, mixtral, qwen2_moe, qwen3_moe
from moejax.models.families.base import Family

# The families, in the order errors list them.
FAMILIES: tuple[Family, ...] = (
  mixtral.MIXTRAL,
  qwen2_moe.QWEN2_MOE,
  qwen3_moe.QWEN3_MOE,
  deepseek.DEEPSEEK_V2,
  deepseek.DEEPSEEK_V3,
  glm4_moe.GLM4_MOE,
  gpt_oss.GPT_OSS,
  dense.LLAMA,
  dense.QWEN3,
)
REGISTRY: dict[str, Family] = {family.model_type: family for family in FAMILIES}  # by model_type


def get(model_type: str) -> Family:
  """The family of a `DecoderConfig.family` (checked there, so a KeyError here is a bug)."""
  return REGISTRY[model_type]
