"""EXAONE-MoE (`exaone_moe`) against transformers: Qwen3's attention whose full-attention layers are global NoPE (no
RoPE where the model slides) but keep their QK-norm (`DecoderConfig.nope_qk_norm`), and DeepSeek-V3's MoE layers with
a shared expert and the balancing bias beside the router (`mlp.e_score_correction_bias`). The fixture
(tests/data/hf/exaone_moe, transformers' ExaoneMoeForCausalLM: 4 layers sliding / full alternating by
sliding_window_pattern 2 with a window of 4 keys, layer 0 dense, 16 experts top-4 in 4 groups) gives logits on the 2 x
4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy tokens through the cache, and the
checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export exaone_moe`, docs/models.md)."""

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
  assert_loads_as,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import fixture_copy, group, reference, tiled

FAMILY = "exaone_moe"
OTHER_PATH = {"path": "gpu_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' ExaoneMoeConfig reads, beyond the shapes every family has
  "layer_types",
  "sliding_window",
  "mlp_layer_types",
  "num_experts",
  "num_shared_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "norm_topk_prob",
  "routed_scaling_factor",
  "n_group",
  "topk_group",
  "intermediate_size",
  "num_key_value_heads",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  cfg = model.cfg
  assert (cfg.nope_layers, cfg.nope_qk_norm, cfg.sliding_layers) == ((False, True) * 2, True, (True, False) * 2)
  assert cfg.moe_layers == (False, True, True, True) and cfg.qk_norm and not cfg.qkv_bias
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
  """The export holds the fixture's tensors bit for bit under the same names (the bias beside the router), and the
  config.json fields transformers reads under ExaoneMoeConfig's names; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("change", ["no_qk_norm_in_nope_layers", "rope_everywhere", "bias_zeroed"])
def test_the_nope_layers_qk_norm_and_the_bias_act(tmp_path, mesh_2x4, change):
  """The controls: the NoPE layers without their QK-norm (as Llama 4's), RoPE in every layer (no NoPE layer), or the
  balancing bias zeroed, and the logits move, so each is what matches transformers."""
  ref = reference(FAMILY)
  directory = fixture_copy(tmp_path, FAMILY)
  overrides = {"no_qk_norm_in_nope_layers": {"nope_qk_norm": False}, "rope_everywhere": {"nope_layers": None}}
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  if change == "bias_zeroed":
    save_file({k: np.zeros_like(v) if k.endswith("e_score_correction_bias") else v for k, v in tensors.items()}, path)
  if change == "no_qk_norm_in_nope_layers":  # the NoPE layers' norms left out (a model without them has none)
    nope_norm = re.compile(r"model\.layers\.[13]\.self_attn\.[qk]_norm\.weight")
    save_file({k: v for k, v in tensors.items() if not nope_norm.fullmatch(k)}, path)
  loaded = models.from_hf(directory, mesh_2x4, model=overrides.get(change, {}))
  assert relative_error(np.asarray(loaded(tiled(ref["tokens"]), details=True)[0])[:2], ref["logits"]) > 1e-3


@pytest.mark.slow
def test_published_mtp_layer_is_ignored(tmp_path, mesh_2x4, model):
  """The published MTP module (`mtp.*`), which transformers ignores, loads as without it."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  save_file({**tensors, "mtp.layers.0.mlp.gate.weight": np.ones((4, 4), np.float32)}, f"{directory}/model.safetensors")
  assert_loads_as(directory, mesh_2x4, model)


@pytest.mark.slow
def test_defaults_are_exaone_moe_configs():
  """What config.json leaves out is ExaoneMoeConfig's default: a window of 4096 with every 4th layer full (NoPE), the
  first layer dense, one shared expert; without a window, RoPE in every layer and no NoPE layer."""
  absent = ("layer_types", "mlp_layer_types", "sliding_window", "sliding_window_pattern", "num_shared_experts")
  hf = {**{k: v for k, v in config().items() if k not in absent}, "num_hidden_layers": 8}
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert (cfg.sliding_window, cfg.nope_layers) == (4096, (False, False, False, True) * 2)
  assert cfg.moe_layers == (False,) + (True,) * 7 and moe_cfg.num_shared_experts == 1
  cfg, _ = hf_config.from_hf_config({**hf, "sliding_window": None})
  assert (cfg.sliding_window, cfg.nope_layers) == (None, None)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("nope_qk_norm", False),
    ("nope_layers", None),
    ("qk_norm", False),
    ("moe.score", "softmax"),
    ("num_mtp_layers", 1),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
