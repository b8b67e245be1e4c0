"""Qwen3-Next against transformers: layers of two token mixers (`DecoderConfig.mixers`, `moejax.models.token_mixers`):
gated DeltaNet layers (`linear_attn`) between gated attention layers (q_proj's per-head gate, partial RoPE 0.25,
(1 + weight) QK-norm), (1 + weight) block norms, Qwen2-MoE's MoE layers with a sigmoid-gated shared expert. The
fixture (tests/data/hf/qwen3_next, transformers' Qwen3NextForCausalLM: layer_types [linear, full] x 2, 8 experts
top-2) gives logits on the 2 x 4 mesh scanned (segments of period 2: a DeltaNet layer, an attention layer) and
unrolled under another MoE path, the routers' choices, greedy tokens through the cache (DeltaNet layers cache their
convolution's inputs and state, attention layers k and v), and the checkpoint written back bit for bit; the export
loads back in transformers with the fixture's logits (`make_hf_fixtures.py --check-export qwen3_next`,
docs/models.md). Here too what Qwen3-Next's config.json says its own way and what it cannot say.
"""

import dataclasses
import functools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from moejax.infer import cache as cache_lib
from moejax.models import hf_config, layers, token_mixers
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.hf_family_checks import (
  SHAPES,
  assert_loads_as,
  check_against_reference,
  check_greedy_generation,
  check_round_trip,
  check_under_tensor_parallelism,
  from_hf_under,
)
from tests.test_hf_models import (
  DATA,
  fixture_copy,
  group,
  reference,
  refused,
)

FAMILY = "qwen3_next"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' Qwen3NextConfig reads, beyond the shapes every family has
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "shared_expert_intermediate_size",
  "norm_topk_prob",
  "mlp_only_layers",
  "decoder_sparse_step",
  "layer_types",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "linear_key_head_dim",
  "linear_value_head_dim",
  "linear_conv_kernel_dim",
  "attention_bias",
  "head_dim",
  "num_key_value_heads",
  "rms_norm_eps",
  "rope_parameters",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  """Scanned (the default): one segment of period 2 repeated twice, a DeltaNet sub-layer and an attention one."""
  assert model.cfg.scan_layers and layers.segments(model.cfg) == (layers.Segment(0, 2, 2),)
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, OTHER_PATH)
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled(mesh_2x4):
  check_against_reference(models.from_hf(str(DATA / FAMILY), mesh_2x4, model={"scan_layers": False}), reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  check_greedy_generation(model, FAMILY)


@pytest.mark.slow
def test_exflow_generation_matches_transformers(model):
  """ExFlow's step writes an attention layer's new keys and values at their position and a DeltaNet layer's state
  whole."""
  check_greedy_generation(model, FAMILY, mode="exflow")


@pytest.mark.slow
def test_greedy_generation_unrolled(mesh_2x4):
  check_greedy_generation(models.from_hf(str(DATA / FAMILY), mesh_2x4, model={"scan_layers": False}), FAMILY)


def test_round_trip(model, tmp_path, mesh_2x4):
  """The export holds the fixture's tensors bit for bit under the same names (`linear_attn.*` for the DeltaNet
  layers), and the config.json fields transformers reads; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


# ---------------------------------------------------------------------------------------------------------------
# What Qwen3-Next's config.json says its own way


def test_reads_mixers_gates_offset_norms_and_partial_rope():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.mixers == ("gated_deltanet", "attention") * 2
  assert (cfg.gated_attention, cfg.norm_offset, cfg.qk_norm, cfg.qk_norm_mode) == (True, True, True, "head")
  assert (cfg.partial_rotary_factor, cfg.rope_dim, cfg.sliding_window) == (0.25, 4, None)
  linear = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
  assert linear == (2, 4, 8, 8) and cfg.linear_conv_kernel == 4
  assert (moe_cfg.num_shared_experts, moe_cfg.shared_gate, moe_cfg.renormalize) == (1, True, True)
  assert [token_mixers.of(cfg, i).hf_module for i in range(4)] == ["linear_attn", "self_attn"] * 2


def test_defaults_are_qwen3_next_configs():
  """Without layer_types every full_attention_interval-th layer (default 4) is attention; without a
  partial_rotary_factor a quarter of each head rotates; head_dim 256 and norm_topk_prob true by default."""
  absent = ("layer_types", "rope_parameters", "norm_topk_prob")
  hf = {k: v for k, v in config().items() if k not in absent}
  cfg, moe_cfg = hf_config.from_hf_config({**hf, "num_hidden_layers": 8, "mlp_only_layers": []})
  assert cfg.mixers == ("gated_deltanet",) * 3 + ("attention",) + ("gated_deltanet",) * 3 + ("attention",)
  assert cfg.partial_rotary_factor == 0.25 and moe_cfg.renormalize
  cfg, _ = hf_config.from_hf_config({**hf, "full_attention_interval": 2})
  assert cfg.mixers == ("gated_deltanet", "attention") * 2
  cfg, _ = hf_config.from_hf_config({k: v for k, v in config().items() if k != "head_dim"})
  assert cfg.head_dim == 256
  with pytest.raises(ConfigError, match="layer_types"):
    hf_config.from_hf_config({**config(), "layer_types": ["linear_attention", "sliding_attention"] * 2})


def test_cache_has_each_mixers_entries(mesh_2x4):
  """A DeltaNet layer's cache: its convolution's last 3 inputs [B, 3, 2 x 16 + 32] in the compute dtype and its
  state [B, 4, 8, 8] float32, no sequence axis; an attention layer's k and v [B, S, 2, 16]. Scanned: per
  sub-layer, stacked over the segment's 2 repeats."""
  cfg, _ = hf_config.from_hf_config(config())
  got = cache_lib.init_cache(cfg, 8, 20, mesh_2x4)
  shapes = [[tuple((a.shape, str(a.dtype)) for a in pair) for pair in seg] for seg in got]
  deltanet = (((2, 8, 3, 64), "float32"), ((2, 8, 4, 8, 8), "float32"))
  assert shapes == [[deltanet, (((2, 8, 20, 2, 16), "float32"),) * 2]]
  unrolled = cache_lib.init_cache(dataclasses.replace(cfg, scan_layers=False, dtype="bfloat16"), 8, 20, mesh_2x4)
  assert [a.shape for a in unrolled[0]] == [(8, 3, 64), (8, 4, 8, 8)]
  assert [str(a.dtype) for a in unrolled[0]] == ["bfloat16", "float32"]


def test_export_refuses_what_config_json_cannot_say():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  for name, value in (("gated_attention", False), ("norm_offset", False), ("qk_norm", False)):
    with pytest.raises(ConfigError, match=name):
      hf_config.to_hf_config(dataclasses.replace(cfg, **{name: value}), moe_cfg)
  with pytest.raises(ConfigError, match="shared_gate"):
    hf_config.to_hf_config(cfg, dataclasses.replace(moe_cfg, shared_gate=False))
  # another family's config.json has no per-layer mixers, gates or offset norms
  other = dataclasses.replace(cfg, family="qwen3_moe", gated_attention=False, norm_offset=False)
  with pytest.raises(ConfigError, match="mixers"):
    hf_config.to_hf_config(other, moe_cfg)


def test_config_refuses_bad_mixers():
  cfg, _ = hf_config.from_hf_config(config())
  with pytest.raises(ConfigError, match="mixers"):
    dataclasses.replace(cfg, mixers=("gated_deltanet", "mamba", "attention", "attention"))
  with pytest.raises(ConfigError, match="linear_num_value_heads"):
    dataclasses.replace(cfg, linear_num_value_heads=3)
  with pytest.raises(ConfigError, match="gated_attention"):
    dataclasses.replace(cfg, mixers=None, gated_attention=True, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
                        qk_nope_head_dim=8, partial_rotary_factor=1.0)  # fmt: skip


def test_published_mtp_tensors_are_ignored_others_refused(tmp_path, mesh_2x4, model):
  """The published checkpoints' MTP module (`mtp.*`), which transformers ignores, loads as without it; any other
  tensor the config does not name is refused."""
  directory = fixture_copy(tmp_path, FAMILY)
  tensors = load_file(os.path.join(directory, "model.safetensors"))
  extra = np.ones((4, 4), np.float32)
  save_file({**tensors, "mtp.fc.weight": extra}, os.path.join(directory, "model.safetensors"))
  assert_loads_as(directory, mesh_2x4, model)
  save_file({**tensors, "model.mtp.fc.weight": extra}, os.path.join(directory, "model.safetensors"))
  assert "model.mtp.fc.weight" in refused(directory, mesh_2x4)


@pytest.mark.slow
def test_under_tensor_parallelism(devices):
  """Heads split over 'gpu' (4 nodes x 2 GPUs): each device's heads of the gated q_proj hold their queries and gates
  together; the DeltaNet layers' tensors replicated, each GPU running the whole layer; the logits stay transformers'."""
  check_under_tensor_parallelism(FAMILY)
