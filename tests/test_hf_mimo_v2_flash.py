"""MiMo-V2-Flash against transformers: GQA with value heads narrower than q and k (`DecoderConfig.v_head_dim`), the
values scaled (`value_scale`), full_attention and sliding_attention layers, the sliding ones with twice the kv heads,
a sink logit per head and their own partial RoPE (`DecoderConfig.sliding_overrides`, `DecoderConfig.at`), a dense
first layer, then DeepSeek-V3's router without shared experts. The fixture (tests/data/hf/mimo_v2_flash,
transformers' MiMoV2FlashForCausalLM: layers [full, sliding, sliding, full], q and k 24 wide, v 16, window 4) gives
logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy tokens through
the cache (each layer its own kv heads and widths), and the checkpoint written back bit for bit; the export loads
back in transformers with the fixture's logits (`make_hf_fixtures.py --check-export mimo_v2_flash`, docs/models.md).
Here too what its config.json says its own way and what it cannot say.
"""

import dataclasses
import functools
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moejax.infer import cache as cache_lib
from moejax.models import hf_checkpoint, hf_config, layers
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.hf_family_checks import (
  SHAPES,
  assert_loads_as,
  check_against_reference,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import (
  DATA,
  fixture_copy,
  group,
  reference,
  refused,
)

FAMILY = "mimo_v2_flash"
OTHER_PATH = {"path": "gpu_first", "dedup": True, "schedule": "chunked", "num_chunks": 2}
FIELDS = (  # config.json fields transformers' MiMoV2FlashConfig reads, beyond the shapes every family has
  "n_routed_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "routed_scaling_factor",
  "norm_topk_prob",
  "n_group",
  "topk_group",
  "mlp_layer_types",
  "layer_types",
  "sliding_window",
  "head_dim",
  "v_head_dim",
  "attention_value_scale",
  "attention_bias",
  "num_key_value_heads",
  "intermediate_size",
  "rms_norm_eps",
  "rope_parameters",
)
SLIDING = (("attention_sinks", True), ("num_kv_heads", 4), ("partial_rotary_factor", 0.5), ("rope_theta", 500.0))
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  """Scanned: the dense full layer 0, the two sliding MoE layers stacked, the full MoE layer 3."""
  segments = (layers.Segment(0, 1, 1), layers.Segment(1, 1, 2), layers.Segment(3, 1, 1))
  assert model.cfg.scan_layers and layers.segments(model.cfg) == segments
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
  """The export holds the fixture's tensors bit for bit under the same names (the sliding layers' sinks as
  `self_attn.attention_sink_bias`), and the config.json fields transformers reads; loaded again, the same
  parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


# ---------------------------------------------------------------------------------------------------------------
# What MiMo-V2-Flash's config.json says its own way


@pytest.mark.slow
def test_reads_narrow_values_and_the_sliding_layers_own_attention():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert (cfg.head_dim, cfg.v_head_dim, cfg.value_dim, cfg.value_scale) == (24, 16, 16, 0.707)
  assert (cfg.num_kv_heads, cfg.attention_sinks, cfg.rope_theta, cfg.partial_rotary_factor) == (2, False, 1e4, 0.334)
  assert cfg.sliding_layers == (False, True, True, False) and cfg.sliding_window == 4
  assert cfg.sliding_overrides == SLIDING
  sliding = cfg.at(1)
  assert (sliding.num_kv_heads, sliding.attention_sinks, sliding.rope_dim, cfg.rope_dim) == (4, True, 12, 8)
  assert cfg.at(0) is cfg and cfg.at(3) is cfg and cfg.at(2) is sliding
  assert (cfg.qkv_bias, cfg.out_bias, cfg.qk_norm, cfg.moe_layers) == (True, False, False, (False, True, True, True))
  assert (moe_cfg.score, moe_cfg.num_groups, moe_cfg.topk_groups, moe_cfg.routed_scaling) == ("sigmoid", 4, 2, 1.5)
  assert (moe_cfg.num_shared_experts, moe_cfg.renormalize) == (0, True) and moe_cfg.bias_update_rate > 0
  assert hf_checkpoint.hf_key(("blocks", 1, "attn", "sinks"), cfg)[0] == "model.layers.1.self_attn.attention_sink_bias"


@pytest.mark.slow
def test_cache_holds_each_layers_heads_and_widths(mesh_2x4):
  """Full layers cache k [B, S, 2, 24] and v [B, S, 2, 16]; sliding layers twice the kv heads."""
  cfg, _ = hf_config.from_hf_config(config())
  got = cache_lib.init_cache(dataclasses.replace(cfg, scan_layers=False), 8, 20, mesh_2x4)
  full, sliding = [(8, 20, 2, 24), (8, 20, 2, 16)], [(8, 20, 4, 24), (8, 20, 4, 16)]
  assert [[a.shape for a in pair] for pair in got] == [full, sliding, sliding, full]


@pytest.mark.slow
def test_defaults_are_mimo_configs():
  """Without layer_types layer 0 and every 6th are full; without rope_parameters MiMo's thetas (5e6 full, 1e4
  sliding) and factor 0.334; sliding_window_size is the window less one; a null scaling factor is 1."""
  absent = ("layer_types", "rope_parameters", "sliding_window", "attention_value_scale", "v_head_dim")
  hf = {k: v for k, v in config().items() if k not in absent}
  hf.update(num_hidden_layers=7, mlp_layer_types=None, sliding_window_size=8, routed_scaling_factor=None)
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  assert cfg.sliding_layers == (False, True, True, True, True, False, True) and cfg.sliding_window == 9
  assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.at(1).rope_theta) == (5e6, 0.334, 1e4)
  assert (cfg.value_scale, cfg.v_head_dim, moe_cfg.routed_scaling) == (0.707, 128, 1.0)
  with pytest.raises(ConfigError, match="rope_parameters"):
    hf_config.from_hf_config({**config(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.mark.slow
def test_export_refuses_what_config_json_cannot_say():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  for overrides in (SLIDING[1:], (("attention_sinks", False),) + SLIDING[1:]):
    with pytest.raises(ConfigError, match="sliding_overrides"):
      hf_config.to_hf_config(dataclasses.replace(cfg, sliding_overrides=overrides), moe_cfg)
  with pytest.raises(ConfigError, match="moe.num_shared_experts"):
    hf_config.to_hf_config(cfg, dataclasses.replace(moe_cfg, num_shared_experts=1, shared_d_ff=16))
  # another family's config.json has no narrower values, value scale or sliding layers of their own
  qwen = json.loads((DATA / "qwen3_moe" / "config.json").read_text())
  plain, plain_moe = hf_config.from_hf_config(qwen)
  for name, value in (("v_head_dim", 8), ("value_scale", 0.5)):
    with pytest.raises(ConfigError, match=name):
      hf_config.to_hf_config(dataclasses.replace(plain, **{name: value}), plain_moe)


@pytest.mark.slow
def test_published_mtp_tensors_are_ignored(tmp_path, mesh_2x4, model):
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  save_file({**tensors, "model.mtp.layers.0.fc.weight": np.ones((4, 4), np.float32)}, f"{directory}/model.safetensors")
  assert_loads_as(directory, mesh_2x4, model)
  save_file({**tensors, "model.extra.weight": np.ones((4, 4), np.float32)}, f"{directory}/model.safetensors")
  assert "model.extra.weight" in refused(directory, mesh_2x4)
