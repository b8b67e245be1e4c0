"""Kimi Linear against transformers: layers of two token mixers under `self_attn` (`DecoderConfig.mixers`): Kimi delta
attention (`kimi_delta`: the delta rule with a decay per key channel, `moejax.models.kimi_delta_attention`) between
MLA layers without RoPE (`nope_layers`), a dense first layer, then DeepSeek-V3's router with a shared expert. The
fixture (tests/data/hf/kimi_linear, transformers' KimiLinearForCausalLM: layer_types [linear, full] x 2, 16 experts
top-4 in 4 groups, the published tensor names) gives logits on the 2 x 4 mesh scanned and unrolled under another MoE
path, the routers' choices, greedy tokens through the cache (KDA layers cache their convolution's inputs and state, MLA
layers the latent and the unrotated shared key), and the checkpoint written back bit for bit; the export loads back in
transformers with the fixture's logits (`make_hf_fixtures.py --check-export kimi_linear`, docs/models.md). Here too
what its config.json says its own way (KimiLinearConfig's attribute_map names, the published linear_attn_config).
"""

import dataclasses
import functools

import pytest

from moejax.models import hf_config, token_mixers
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.hf_family_checks import (
  SHAPES,
  check_against_reference,
  check_greedy_generation,
  check_round_trip,
  check_under_tensor_parallelism,
  from_hf_under,
)
from tests.test_hf_models import group, reference

FAMILY = "kimi_linear"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' KimiLinearConfig reads, beyond the shapes every family has
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "num_experts",
  "num_experts_per_token",
  "moe_intermediate_size",
  "num_shared_experts",
  "routed_scaling_factor",
  "moe_renormalize",
  "num_expert_group",
  "topk_group",
  "mlp_layer_types",
  "layer_types",
  "linear_num_heads",
  "linear_head_dim",
  "linear_conv_kernel_dim",
  "model_max_length",
  "rms_norm_eps",
  "intermediate_size",
)
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_reads_its_config_and_refuses_what_it_cannot_say():
  """layer_types as mixers (both under self_attn), every layer NoPE, the linear sizes, DeepSeek-V3's routing from
  KimiLinearConfig's names; the published linear_attn_config (1-indexed layers) reads the same; the export refuses
  RoPE, another mixer, MTP modules and a router its config.json cannot say."""
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.mixers == ("kimi_delta", "attention") * 2 and cfg.nope_layers == (True,) * 4
  assert [token_mixers.of(cfg, i).hf_module for i in range(4)] == ["self_attn"] * 4
  assert (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel, cfg.max_len) == (4, 8, 4, 64)
  assert cfg.latent and cfg.moe_layers == (False, True, True, True) and cfg.num_mtp_layers == 0
  routing = (moe_cfg.score, moe_cfg.num_groups, moe_cfg.topk_groups, moe_cfg.top_k, moe_cfg.routed_scaling)
  assert routing == ("sigmoid", 4, 2, 4, 2.5) and moe_cfg.renormalize and moe_cfg.num_shared_experts == 1
  sizes = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "layer_types", "mlp_layer_types")
  published = {k: v for k, v in config().items() if k not in sizes}
  published |= {
    "first_k_dense_replace": 1,
    "linear_attn_config": {
      "num_heads": 4,
      "head_dim": 8,
      "short_conv_kernel_size": 4,
      "kda_layers": [1, 3],
      "full_attn_layers": [2, 4],
    },
  }
  assert hf_config.from_hf_config(published) == (cfg, moe_cfg)
  for name, value in (("nope_layers", None), ("num_mtp_layers", 1)):
    with pytest.raises(ConfigError, match=name):
      hf_config.to_hf_config(dataclasses.replace(cfg, **{name: value}), moe_cfg)
  with pytest.raises(ConfigError, match="mixers"):
    hf_config.to_hf_config(dataclasses.replace(cfg, mixers=("gated_deltanet", "attention") * 2), moe_cfg)
  with pytest.raises(ConfigError, match="score"):
    hf_config.to_hf_config(cfg, dataclasses.replace(moe_cfg, score="softmax"))
  with pytest.raises(ConfigError, match="linear_num_value_heads"):
    dataclasses.replace(cfg, linear_num_key_heads=2)


@pytest.mark.slow
def test_logits_and_routing_match_transformers(model):
  """Scanned (the default)."""
  assert model.cfg.scan_layers
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
  """The export holds the fixture's tensors bit for bit under the published names (block_sparse_moe, w1/w2/w3,
  q/k/v_conv1d), and the config.json fields transformers reads; loaded again, the same parameters."""
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)


@pytest.mark.slow
def test_under_tensor_parallelism():
  """Heads split over 'gpu' (4 nodes x 2 GPUs): the KDA layers' q, k, v and o projections by heads as attention's
  names say, the rest replicated; the logits stay transformers'."""
  check_under_tensor_parallelism(FAMILY)
