"""Lara Mini (`lara_mini`) against transformers: Qwen3.5's gated DeltaNet layers (their input projections stored fused
in one `in_proj` by rows, as published), sliding attention layers with RoPE and full ones without it keeping their
QK-norm (`DecoderConfig.nope_qk_norm`), every layer MoE with an ungated shared expert and stacked experts. The fixture
(tests/data/hf/lara_mini, transformers' LaraMiniForCausalLM: layer_types [linear, sliding, full] x 2, window 4, 8
experts top-2) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices,
greedy tokens through the DeltaNet and KV caches, and the checkpoint written back bit for bit (the fused in_proj
joined again); the export loads back in transformers with the fixture's logits (`make_hf_fixtures.py --check-export
lara_mini`, docs/models.md)."""

import functools

import numpy as np
import pytest

import moejax.models as models
from moejax.models import hf_config
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

FAMILY = "lara_mini"
OTHER_PATH = {"path": "gpu_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (
  "layer_types",
  "sliding_window",
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "shared_expert_intermediate_size",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "linear_key_head_dim",
  "linear_value_head_dim",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  cfg = model.cfg
  assert cfg.mixers == ("gated_deltanet", "attention", "attention") * 2 and cfg.linear_split_projections
  assert (cfg.nope_layers, cfg.sliding_layers, cfg.nope_qk_norm) == (
    (False, False, True) * 2,
    (False, True, False) * 2,
    True,
  )
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH, model={"scan_layers": False})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  check_greedy_generation(model, FAMILY)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the same names: the DeltaNet's fused in_proj joined from
  its rows, the stacked experts as transformers' modules hold them; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("override", [{"nope_layers": None}, {"sliding_window": None, "sliding_layers": None}], ids=str)
def test_the_nope_and_sliding_layers_act(mesh_2x4, override):
  """The controls: RoPE in the full layers, or no window in the sliding ones, and the logits are others."""
  ref = reference(FAMILY)
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, model=override)
  assert relative_error(np.asarray(other(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_defaults_are_lara_mini_configs():
  """Without layer_types, LaraMiniConfig's released period [linear, sliding, linear, full, sliding]."""
  cfg, _ = hf_config.from_hf_config(
    {**{k: v for k, v in config().items() if k != "layer_types"}, "num_hidden_layers": 5}
  )
  assert cfg.mixers == ("gated_deltanet", "attention", "gated_deltanet", "attention", "attention")
  assert cfg.nope_layers == (False, False, False, True, False) and cfg.sliding_layers == (
    False,
    True,
    False,
    False,
    True,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value", [("nope_qk_norm", False), ("gated_attention", True), ("norm_offset", True), ("moe.shared_gate", True)]
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
