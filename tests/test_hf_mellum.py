"""Mellum (`mellum`) against transformers: Qwen3-MoE's decoder with sliding and full layers by layer_types, each layer
type its own RoPE theta (the sliding layers' by `DecoderConfig.sliding_overrides`), MoE layers by mlp_layer_types. The
fixture (tests/data/hf/mellum, transformers' MellumForCausalLM: 4 layers sliding / full alternating with a window of
6 keys, thetas 1e4 / 5e5, layer 0 dense, 8 experts top-2) gives logits on the 2 x 4 mesh scanned and unrolled under
another MoE path, the routers' choices, greedy tokens through the cache, and the checkpoint written back bit for bit;
the export loads back in transformers with the fixture's logits (`make_hf_fixtures.py --check-export mellum`,
docs/models.md). Here too what its config.json says its own way."""

import functools
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.models import hf_config
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.helpers import relative_error
from tests.hf_family_checks import (
  SHAPES,
  assert_loads_as,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import fixture_copy, group, reference, tiled

FAMILY = "mellum"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' MellumConfig reads, beyond the shapes every family has
  "layer_types",
  "sliding_window",
  "mlp_layer_types",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "norm_topk_prob",
  "intermediate_size",
  "num_key_value_heads",
  "head_dim",
  "attention_bias",
  "rope_parameters",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
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
  """The export holds the fixture's tensors bit for bit under the same names, and the config.json fields
  transformers reads (the per-type rope_parameters among them); loaded again, the same parameters."""
  _, got = check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)
  assert got["num_experts"] == config()["num_local_experts"]  # MellumConfig's alias


@pytest.mark.slow
@pytest.mark.parametrize("change", ["window", "theta"])
def test_the_window_and_the_sliding_theta_act(tmp_path, mesh_2x4, change):
  """The controls: without the window, or with the sliding layers on the full layers' theta, the logits move, so
  each is what matches transformers."""
  directory = fixture_copy(tmp_path, FAMILY)
  hf = config()
  if change == "window":
    hf["layer_types"] = ["full_attention"] * 4
  else:
    hf["rope_parameters"]["sliding_attention"]["rope_theta"] = 500000.0
  open(os.path.join(directory, "config.json"), "w").write(json.dumps(hf))
  ref = reference(FAMILY)
  logits, _ = models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]), details=True)
  logits = np.asarray(logits)
  assert relative_error(logits[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_published_mtp_layer_is_ignored(tmp_path, mesh_2x4, model):
  """The published MTP layer (`mtp.*`), which transformers ignores, loads as without it."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  save_file({**tensors, "mtp.layers.0.mlp.gate.weight": np.ones((4, 4), np.float32)}, f"{directory}/model.safetensors")
  assert_loads_as(directory, mesh_2x4, model)


# ---------------------------------------------------------------------------------------------------------------
# What Mellum's config.json says its own way


@pytest.mark.slow
def test_reads_layer_types_and_each_types_theta():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert (
    cfg.moe_layers == (False, True, True, True) and cfg.d_ff == 48 and (cfg.qk_norm, cfg.qk_norm_mode) == (1, "head")
  )
  assert (cfg.sliding_window, cfg.sliding_layers, cfg.rope_theta) == (6, (True, False, True, False), 5e5)
  assert cfg.sliding_overrides == (("rope_theta", 1e4),) and cfg.at(0).rope_theta == 1e4 and cfg.at(1).rope_theta == 5e5
  assert (moe_cfg.score, moe_cfg.renormalize, moe_cfg.num_shared_experts, moe_cfg.num_experts) == ("softmax", 1, 0, 8)


@pytest.mark.slow
def test_defaults_are_mellum_configs():
  """What config.json leaves out is MellumConfig's default: every layer full and MoE, thetas 5e5 (and 1e4 in sliding
  layers), norm_topk_prob true; a RoPE other than the default over the whole head is refused by rope_parameters."""
  absent = ("layer_types", "mlp_layer_types", "rope_parameters", "norm_topk_prob")
  cfg, moe_cfg = hf_config.from_hf_config({k: v for k, v in config().items() if k not in absent})
  assert (cfg.sliding_window, cfg.moe_layers, cfg.rope_theta, moe_cfg.renormalize) == (None, (True,) * 4, 5e5, True)
  hf = {k: v for k, v in config().items() if k != "rope_parameters"}
  assert hf_config.from_hf_config(hf)[0].sliding_overrides == (("rope_theta", 1e4),)
  for kind in (
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
    {"rope_theta": 1e4, "partial_rotary_factor": 0.5},
  ):
    with pytest.raises(ConfigError, match="rope_parameters"):
      hf_config.from_hf_config(
        {**config(), "rope_parameters": {**config()["rope_parameters"], "sliding_attention": kind}}
      )


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("sliding_overrides", (("num_kv_heads", 4), ("rope_theta", 1e4))),
    ("qk_norm", False),
    ("attention_sinks", True),
    ("partial_rotary_factor", 0.5),
    ("moe.score", "sigmoid"),
    ("moe.num_shared_experts", 1),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
