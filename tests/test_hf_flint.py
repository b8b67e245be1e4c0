"""Flint (`flint`) against transformers: Qwen3's attention with a sink logit per head in every layer, rotary only in
the sliding layers, the full layers NoPE keeping their QK-norm (`DecoderConfig.nope_qk_norm`); sigmoid top-k routing
without a bias, renormalised, and an ungated shared expert. The fixture (tests/data/hf/flint, transformers'
FlintForCausalLM: 4 layers sliding / full alternating with a window of 4 keys, layer 0 dense, 16 experts top-4, a
shared expert of width 24) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers'
choices, greedy tokens through the cache, and the checkpoint written back bit for bit; the export loads back in
transformers with the fixture's logits (`make_hf_fixtures.py --check-export flint`, docs/models.md)."""

import functools
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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
from tests.test_hf_models import fixture_copy, group, reference, tiled

FAMILY = "flint"
OTHER_PATH = {"path": "node_first", "collective": "capacity", "capacity_factor": 8.0}
FIELDS = (  # config.json fields transformers' FlintConfig reads, beyond the shapes every family has
  "layer_types",
  "sliding_window",
  "mlp_only_layers",
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "shared_expert_intermediate_size",
  "norm_topk_prob",
  "intermediate_size",
  "num_key_value_heads",
  "head_dim",
  "attention_bias",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  cfg, moe_cfg = model.cfg, model.moe_cfg
  assert (cfg.nope_layers, cfg.nope_qk_norm, cfg.sliding_layers) == ((False, True) * 2, True, (True, False) * 2)
  assert cfg.attention_sinks and cfg.moe_layers == (False, True, True, True)
  assert (moe_cfg.score, moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.shared_gate) == (
    "sigmoid",
    True,
    1,
    False,
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
  """The export holds the fixture's tensors bit for bit under the same names (the sinks as the hub's
  softmax_offset), and the config.json fields transformers reads; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["no_qk_norm_in_nope_layers", "rope_everywhere", "sinks_zeroed"])
def test_the_nope_layers_qk_norm_and_the_sinks_act(tmp_path, mesh_2x4, change):
  """The controls: the NoPE layers without their QK-norm, RoPE in every layer, or the sinks zeroed, and the logits
  move, so each is what matches transformers."""
  ref = reference(FAMILY)
  directory = fixture_copy(tmp_path, FAMILY)
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  overrides = {"no_qk_norm_in_nope_layers": {"nope_qk_norm": False}, "rope_everywhere": {"nope_layers": None}}
  if change == "sinks_zeroed":
    save_file({k: np.zeros_like(v) if k.endswith("softmax_offset") else v for k, v in tensors.items()}, path)
  if change == "no_qk_norm_in_nope_layers":  # the NoPE layers' norms left out (a model without them has none)
    nope_norm = re.compile(r"model\.layers\.[13]\.self_attn\.[qk]_norm\.weight")
    save_file({k: v for k, v in tensors.items() if not nope_norm.fullmatch(k)}, path)
  loaded = models.from_hf(directory, mesh_2x4, model=overrides.get(change, {}))
  assert relative_error(np.asarray(loaded(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_defaults_are_flint_configs():
  """What config.json leaves out is FlintConfig's default: full (NoPE) layers the first two, every i % 4 == 1 and the
  last, the rest sliding by 513; layers 0 and 1 dense. A null window: every layer NoPE."""
  absent = ("layer_types", "mlp_only_layers", "sliding_window")
  cfg, _ = hf_config.from_hf_config({**{k: v for k, v in config().items() if k not in absent}, "num_hidden_layers": 8})
  full = (True, True, False, False, False, True, False, True)
  assert (cfg.sliding_window, cfg.nope_layers, cfg.sliding_layers) == (513, full, tuple(not f for f in full))
  assert cfg.moe_layers == (False, False) + (True,) * 6
  # a null window: no layer slides, so none rotates (transformers rotates only where a layer has its window)
  cfg, _ = hf_config.from_hf_config({**config(), "sliding_window": None})
  assert (cfg.sliding_window, cfg.nope_layers) == (None, (True,) * 4)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("nope_qk_norm", False),
    ("nope_layers", None),
    ("attention_sinks", False),
    ("moe.score", "softmax"),
    ("moe.shared_gate", True),
    ("moe.num_groups", 4),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
