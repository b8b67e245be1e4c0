"""HY V3 (`hy_v3`) against transformers: Qwen3's attention (per-head QK-norm), MoE layers by mlp_layer_types,
MiniMax-M2's sigmoid routing whose choice adds the MoE block's bias (`mlp.expert_bias`) and whose renormalised weights
are scaled by router_scaling_factor, a shared expert (`mlp.shared_mlp`), the router under its published name
(`mlp.router.gate.weight`). The fixture (tests/data/hf/hy_v3, transformers' HYV3ForCausalLM: 3 layers, MoE in 1 and
2, 8 experts top-2) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices,
greedy tokens through the cache, and the checkpoint written back bit for bit; the export loads back in transformers
with the fixture's logits (`make_hf_fixtures.py --check-export hy_v3`, docs/models.md)."""

import functools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.models import hf_checkpoint, hf_config
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

FAMILY = "hy_v3"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' HYV3Config reads, beyond the shapes every family has
  "mlp_layer_types",
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "num_shared_experts",
  "router_scaling_factor",
  "intermediate_size",
  "num_key_value_heads",
  "head_dim",
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
  """The export holds the fixture's tensors bit for bit under the published names, and the config.json fields
  transformers reads; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
def test_the_blocks_bias_chooses(tmp_path, mesh_2x4):
  """The control: with the block's bias zeroed the routers choose otherwise, so the bias is what matches them."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  zeroed = {k: np.zeros_like(v) if k.endswith("expert_bias") else v for k, v in tensors.items()}
  save_file(zeroed, os.path.join(directory, "model.safetensors"))
  ref = reference(FAMILY)
  _, aux = models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]), details=True)
  ids = np.sort(np.asarray(aux["expert_ids"])[:, : ref["router_ids"].shape[1]], axis=-1)
  assert not np.array_equal(ids, ref["router_ids"])


@pytest.mark.slow
def test_published_mtp_layer_is_ignored(tmp_path, mesh_2x4, model):
  """The published MTP layer (`model.layers.80.*`), which transformers ignores, loads as without it."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  extra = {"model.layers.80.mlp.gate_proj.weight": np.ones((4, 4), np.float32)}
  save_file({**tensors, **extra}, os.path.join(directory, "model.safetensors"))
  assert_loads_as(directory, mesh_2x4, model)


# ---------------------------------------------------------------------------------------------------------------
# What HY V3's config.json says its own way


@pytest.mark.slow
def test_reads_layer_types_qk_norm_and_scaled_sigmoid_routing():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.moe_layers == (False, True, True) and cfg.d_ff == 48 and (cfg.qk_norm, cfg.qk_norm_mode) == (1, "head")
  assert (cfg.qkv_bias, cfg.out_bias, cfg.sliding_window, cfg.rms_eps) == (0, 0, None, 1e-5)
  routing = (moe_cfg.score, moe_cfg.renormalize, moe_cfg.routed_scaling, moe_cfg.num_groups)
  assert routing == ("sigmoid", 1, 2.5, None)
  routed = (moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.d_ff, moe_cfg.num_shared_experts, moe_cfg.shared_width)
  assert routed == (8, 2, 16, 1, 16)
  assert moe_cfg.bias_update_rate > 0  # the layer keeps the checkpoint's bias
  key = lambda *path: hf_checkpoint.hf_key(("blocks", 1, "ffn", "moe", *path), cfg)
  assert key("expert_bias") == ("model.layers.1.mlp.expert_bias", False)
  assert key("router", "kernel") == ("model.layers.1.mlp.router.gate.weight", True)


@pytest.mark.slow
def test_defaults_are_hy_v3_configs():
  """What config.json leaves out is HYV3Config's default (theta 11158840, eps 1e-5, the first layer dense, one shared
  expert, router_scaling_factor 2.826)."""
  absent = ("rope_parameters", "rms_norm_eps", "mlp_layer_types", "num_shared_experts", "router_scaling_factor")
  cfg, moe_cfg = hf_config.from_hf_config({k: v for k, v in config().items() if k not in absent})
  assert (cfg.rope_theta, cfg.rms_eps, cfg.moe_layers) == (11_158_840.0, 1e-5, (False, True, True))
  assert (moe_cfg.num_shared_experts, moe_cfg.routed_scaling) == (1, 2.826)
  cfg, _ = hf_config.from_hf_config({**config(), "mlp_layer_types": ["sparse", "dense", "sparse"]})
  assert cfg.moe_layers == (True, False, True)


@pytest.mark.slow
@pytest.mark.parametrize(
  "field, value",
  [
    ("qk_norm", False),
    ("qk_norm_mode", "projection"),
    ("qkv_bias", True),
    ("moe.score", "softmax"),
    ("moe.num_groups", 2),
    ("moe.bias_update_rate", 0.0),
  ],
)
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
