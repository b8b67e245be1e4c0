"""FlexOlmo (`flex_olmo`) against transformers: OLMoE's attention and MoE layers in OLMo 2's post-norm blocks
(`DecoderConfig.post_norm`: each sublayer's output normed before the residual add, not its input). The fixture
(tests/data/hf/flex_olmo, transformers' FlexOlmoForCausalLM: 3 layers, QK-norm over the projections, 8 experts top-2
not renormalised) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices,
greedy tokens through the cache (and through ExFlow's decode, which sums a token's expert outputs itself and norms the
sum), and the checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export flex_olmo`, docs/models.md)."""

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

FAMILY = "flex_olmo"
OTHER_PATH = {"path": "gpu_first", "schedule": "comet", "buffer_factor": 4.0}
FIELDS = ("num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "num_key_value_heads")
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  assert model.cfg.post_norm and model.cfg.qk_norm_mode == "projection" and model.cfg.clip_qkv is None
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vanilla", "exflow"])
def test_greedy_generation_matches_transformers(model, mode):
  check_greedy_generation(model, FAMILY, mode=mode)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the same names (the norms after each sublayer:
  post_attention_layernorm, post_feedforward_layernorm); loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
def test_pre_norm_blocks_give_other_logits(mesh_2x4):
  """The control: the same tensors in pre-norm blocks, and the logits are others."""
  ref = reference(FAMILY)
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, model={"post_norm": False})
  assert relative_error(np.asarray(other(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_post_norm_refused_with_longcats_shortcut_blocks():
  hf = checks.config("longcat_flash")
  with pytest.raises(ConfigError, match="post_norm"):
    hf_config.from_hf_config(hf, model={"post_norm": True})


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("post_norm", False), ("clip_qkv", 8.0), ("moe.score", "sigmoid")])
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
