"""ERNIE-4.5 MoE against transformers: Llama's attention with RoPE in interleaved pairs, MoE layers by
moe_layer_start_index / _end_index / _interval, softmax routing whose choice adds the statics' bias
(`mlp.moe_statics.e_score_correction_bias` [1, E], read as its one row: `hf_parts.item`) and whose weights are
renormalised with the moe_norm_min floor (`MoEConfig.renormalize_min`), a shared expert, tied embeddings. The fixture
(tests/data/hf/ernie4_5_moe, transformers' Ernie4_5_MoeForCausalLM: 4 layers, MoE in 1 and 3, 8 experts top-2) gives
logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy tokens through the
cache, and the checkpoint written back bit for bit; the export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export ernie4_5_moe`, docs/models.md). Here too what its config.json says its own way.
"""

import dataclasses
import functools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.models import hf_checkpoint, hf_config
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
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

FAMILY = "ernie4_5_moe"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' Ernie4_5_MoeConfig reads, beyond the shapes every family has
  "moe_num_experts",
  "moe_k",
  "moe_intermediate_size",
  "moe_num_shared_experts",
  "moe_layer_start_index",
  "moe_layer_end_index",
  "moe_layer_interval",
  "moe_norm_min",
  "use_bias",
  "intermediate_size",
  "num_key_value_heads",
  "rms_norm_eps",
  "tie_word_embeddings",
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
  """The export holds the fixture's tensors bit for bit under the same names (the bias [1, 8] as stored, no
  lm_head: tied), and the config.json fields transformers reads; loaded again, the same parameters."""
  written, _ = check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)
  assert "lm_head.weight" not in written


@pytest.mark.slow
def test_the_statics_bias_chooses(tmp_path, mesh_2x4):
  """The control: with the statics' bias zeroed the routers choose otherwise, so the bias is what matches them."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  zeroed = {k: np.zeros_like(v) if "moe_statics" in k else v for k, v in tensors.items()}
  save_file(zeroed, os.path.join(directory, "model.safetensors"))
  ref = reference(FAMILY)
  _, aux = models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]), details=True)
  ids = np.sort(np.asarray(aux["expert_ids"])[:, : ref["router_ids"].shape[1]], axis=-1)
  assert not np.array_equal(ids, ref["router_ids"])


@pytest.mark.slow
def test_published_mtp_tensors_are_ignored(tmp_path, mesh_2x4, model):
  """The published checkpoints' MTP module (`model.mtp_block.0.*`, ...), which transformers ignores, loads as
  without it."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  extra = {"model.mtp_block.0.mlp.gate_proj.weight": np.ones((4, 4), np.float32)}
  save_file({**tensors, **extra}, os.path.join(directory, "model.safetensors"))
  assert_loads_as(directory, mesh_2x4, model)


# ---------------------------------------------------------------------------------------------------------------
# What ERNIE-4.5's config.json says its own way


@pytest.mark.slow
def test_reads_layers_interleaved_rope_and_biased_softmax_routing():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.moe_layers == (False, True, False, True) and cfg.d_ff == 48 and cfg.tie_embeddings
  assert (cfg.rope_interleaved, cfg.partial_rotary_factor, cfg.qkv_bias, cfg.out_bias, cfg.qk_norm) == (1, 1, 0, 0, 0)
  routing = (moe_cfg.score, moe_cfg.renormalize, moe_cfg.renormalize_min, moe_cfg.num_groups)
  assert routing == ("softmax", 1, 1e-12, None)
  routed = (moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.d_ff, moe_cfg.num_shared_experts, moe_cfg.shared_width)
  assert routed == (8, 2, 16, 1, 16)
  assert moe_cfg.bias_update_rate > 0  # the layer keeps the checkpoint's bias
  key = lambda *path: hf_checkpoint.hf_key(("blocks", 1, "ffn", "moe", *path), cfg)
  assert key("expert_bias") == ("model.layers.1.mlp.moe_statics.e_score_correction_bias#[0]/1", False)
  assert key("router", "kernel") == ("model.layers.1.mlp.gate.weight", True)


@pytest.mark.slow
def test_defaults_and_aliases_are_ernie_configs():
  """What config.json leaves out is Ernie4_5_MoeConfig's default (theta 5e5, tied embeddings, eps 1e-5, MoE from
  layer 1 on every layer, 2 shared experts); num_experts and num_experts_per_tok are aliases."""
  absent = ("rope_parameters", "tie_word_embeddings", "rms_norm_eps", "moe_layer_start_index", "moe_layer_interval")
  absent += ("moe_layer_end_index", "moe_num_shared_experts", "moe_num_experts", "moe_k", "moe_norm_min")
  hf = {k: v for k, v in config().items() if k not in absent}
  cfg, moe_cfg = hf_config.from_hf_config({**hf, "num_experts": 8, "num_experts_per_tok": 2})
  assert (cfg.rope_theta, cfg.tie_embeddings, cfg.rms_eps, cfg.moe_layers) == (5e5, True, 1e-5, (False,) + (True,) * 3)
  assert (moe_cfg.num_shared_experts, moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.renormalize_min) == (2, 8, 2, 1e-12)
  cfg, _ = hf_config.from_hf_config({**config(), "moe_layer_start_index": 0, "moe_layer_end_index": 2})
  assert cfg.moe_layers == (False, True, False, False)
  with pytest.raises(ConfigError, match="use_bias"):
    hf_config.from_hf_config({**config(), "use_bias": True})


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("moe_layers", (True, False, False, True)),
    ("rope_interleaved", False),
    ("qkv_bias", True),
    ("moe.score", "sigmoid"),
    ("moe.routed_scaling", 2.0),
    ("moe.bias_update_rate", 0.0),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)


@pytest.mark.slow
def test_layers_written_as_start_end_and_interval():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  for layers, want in (
    ((False, True, False, True), (1, 3, 2)),
    ((False, True, True, False), (1, 2, 1)),
    ((False, False, False, False), (4, 3, 1)),
  ):
    hf = hf_config.to_hf_config(dataclasses.replace(cfg, moe_layers=layers), moe_cfg)
    assert (hf["moe_layer_start_index"], hf["moe_layer_end_index"], hf["moe_layer_interval"]) == want
    assert hf_config.from_hf_config(hf)[0].moe_layers == layers
