"""Granite MoE (`granitemoe`) against transformers: Mixtral's decoder with Granite's muP scalars (`moejax.models.mup`:
the embeddings x embedding_multiplier, each sublayer's output x residual_multiplier, attention's softmax scale
attention_multiplier, the logits / logits_scaling) and its stacked experts (`block_sparse_moe.input_linear.weight`
[E, 2f, d], `output_linear.weight` [E, d, f]). The fixture (tests/data/hf/granitemoe, transformers'
GraniteMoeForCausalLM: 3 layers, 8 experts top-2, scalars 3, 0.5, 0.2 and 4, d = 2f so that both expert layouts fit the
stored shape) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy
tokens through the cache and ExFlow's decode, and the checkpoint written back bit for bit; the export loads back in
transformers with the fixture's logits (`make_hf_fixtures.py --check-export granitemoe`, docs/models.md)."""

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

FAMILY = "granitemoe"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
FIELDS = ("num_local_experts", "num_experts_per_tok", "intermediate_size", "num_key_value_heads", *SCALARS)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  assert tuple(getattr(model.cfg, name) for name in SCALARS) == (3.0, 0.5, 0.2, 4.0)
  assert model.moe_cfg.renormalize and model.cfg.moe_layers == (True,) * 3
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
  """The export holds the fixture's tensors bit for bit under the same names (the experts stacked as transformers'
  modules hold them), and the scalars; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("scalar", SCALARS)
def test_each_scalar_acts(mesh_2x4, scalar):
  """The controls: each scalar left at its neutral value (attention's: head_dim^-0.5), and the logits are others."""
  ref = reference(FAMILY)
  other = models.from_hf(
    str(DATA / FAMILY), mesh_2x4, model={scalar: None if scalar == "attention_multiplier" else 1.0}
  )
  assert relative_error(np.asarray(other(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_defaults_are_granitemoe_configs():
  """What config.json leaves out is GraniteMoeConfig's default: every scalar 1 (attention's softmax scale too)."""
  cfg, _ = hf_config.from_hf_config({k: v for k, v in config().items() if k not in SCALARS})
  assert tuple(getattr(cfg, name) for name in SCALARS) == (1.0, 1.0, 1.0, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value", [("moe.renormalize", False), ("sliding_window", 4), ("moe.score", "sigmoid"), ("out_bias", True)]
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)


@pytest.mark.slow
@pytest.mark.parametrize(
  "family, field, value",
  [
    ("deepseek_v3", "attention_multiplier", 0.1),  # MLA's softmax scale is its own (YaRN's mscale)
    ("longcat_flash", "residual_multiplier", 0.5),  # its shortcut blocks add their sublayers as published
    ("granitemoe", "logits_scaling", 0.0),
    ("granitemoe", "embedding_multiplier", "2"),
  ],
)
def test_scalars_refused_where_they_cannot_act(family, field, value):
  with pytest.raises(ConfigError, match=field):
    hf_config.from_hf_config(checks.config(family), model={field: value})
