"""Mistral Small 4 (`mistral4`) against transformers: DeepSeek-V3's MLA whose queries are scaled by their position
(`DecoderConfig.query_scaling`: q x (1 + beta log1p(floor(p / original_max))), rope_parameters' llama_4_scaling_beta),
softmax routing in groups by their two best, renormalised and scaled, and experts stacked as transformers' modules hold
them. The fixture (tests/data/hf/mistral4, transformers' Mistral4ForCausalLM: 3 layers, a dense first one, 16 experts
top-4 in 4 groups, a shared expert, YaRN over original_max_position_embeddings 4, beta 0.5, so that positions 4 to 11
are scaled) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy
tokens through the cache, and the checkpoint written back bit for bit; the export loads back in transformers with the
fixture's logits (`make_hf_fixtures.py --check-export mistral4`, docs/models.md)."""

import functools

import numpy as np
import pytest

import moejax.models as models
from moejax.models import hf_config
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.helpers import relative_error
from tests.hf_family_checks import (
  SHAPES,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import DATA, group, reference, tiled

FAMILY = "mistral4"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "n_routed_experts",
  "n_shared_experts",
  "n_group",
  "topk_group",
  "routed_scaling_factor",
  "first_k_dense_replace",
  "rope_parameters",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  cfg, moe_cfg = model.cfg, model.moe_cfg
  assert cfg.latent and cfg.query_scaling == (4.0, 0.5) and cfg.partial_rotary_factor == 1.0
  assert (moe_cfg.score, moe_cfg.group_score, moe_cfg.num_groups, moe_cfg.routed_scaling) == (
    "softmax",
    "top2_sum",
    4,
    2.5,
  )
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  """13 positions through the latent cache, each step's query scaled by its own position."""
  check_greedy_generation(model, FAMILY)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
def test_the_query_scaling_acts(mesh_2x4):
  """The control: without the scaling the logits of positions 4 on are others, those of positions 0 to 3 the same."""
  ref = reference(FAMILY)
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, model={"query_scaling": None})
  logits = np.asarray(other(tiled(ref["tokens"]), details=True)[0])[:2]
  assert relative_error(logits[:, :4], ref["logits"][:, :4]) < 1e-5
  assert relative_error(logits[:, 4:], ref["logits"][:, 4:]) > 1e-3


@pytest.mark.slow
def test_reads_what_mistral4config_says():
  """Without llama_4_scaling_beta no query is scaled; a partial_rotary_factor other than MLA's rotary share is refused."""
  hf = config()
  rope = {k: v for k, v in hf["rope_parameters"].items() if k != "llama_4_scaling_beta"}
  assert hf_config.from_hf_config({**hf, "rope_parameters": rope})[0].query_scaling is None
  with pytest.raises(ConfigError, match="partial_rotary_factor"):
    hf_config.from_hf_config({**hf, "rope_parameters": {**rope, "partial_rotary_factor": 0.5}})


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("moe.score", "sigmoid"),
    ("moe.group_score", "max"),
    ("moe.bias_update_rate", 0.001),
    ("query_scaling", (8.0, 0.5)),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
