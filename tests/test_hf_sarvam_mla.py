"""Sarvam-MLA (`sarvam_mla`) against transformers: DeepSeek-V3's decoder under its own model_type (transformers runs
it as DeepseekV3ForCausalLM), MLA without q LoRA, one routing group, one dense layer first (SarvamMLAConfig's
defaults). The fixture (tests/data/hf/sarvam_mla: 3 layers, MoE in 1 and 2, 16 experts top-4, a shared expert, YaRN)
gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy tokens
through the cache, and the checkpoint written back bit for bit; the export loads back in transformers with the
fixture's logits (`make_hf_fixtures.py --check-export sarvam_mla`, docs/models.md). Here too the original config.json
format SarvamMLAConfig converts (its aliases, head_dim, rope_scaling 'deepseek_yarn')."""

import functools

import pytest

from moejax.models import hf_config
from tests import hf_family_checks as checks
from tests.hf_family_checks import (
  SHAPES,
  check_against_reference,
  check_export_refuses,
  check_greedy_generation,
  check_round_trip,
  from_hf_under,
)
from tests.test_hf_models import group, reference

FAMILY = "sarvam_mla"
OTHER_PATH = {"path": "node_first", "dedup": True, "buffer_factor": 4.0}
FIELDS = (  # config.json fields transformers' SarvamMLAConfig reads, beyond the shapes every family has
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "n_routed_experts",
  "n_shared_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "n_group",
  "topk_group",
  "first_k_dense_replace",
  "norm_topk_prob",
  "routed_scaling_factor",
  "rope_interleave",
  "num_nextn_predict_layers",
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
  """The export is sarvam_mla run as DeepseekV3ForCausalLM, holds the fixture's tensors bit for bit under the same
  names, and the config.json fields transformers reads; loaded again, the same parameters."""
  _, got = check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + FIELDS)
  assert (got["model_type"], got["architectures"]) == ("sarvam_mla", ["DeepseekV3ForCausalLM"])


@pytest.mark.slow
def test_reads_deepseek_v3s_decoder():
  cfg, moe_cfg = hf_config.from_hf_config(config())
  assert cfg.moe_layers == (False, True, True) and cfg.q_lora_rank is None and cfg.kv_lora_rank == 16
  assert (cfg.rope_interleaved, cfg.head_dim, cfg.num_mtp_layers) == (True, 4, 0)
  routing = (moe_cfg.score, moe_cfg.renormalize, moe_cfg.routed_scaling, moe_cfg.num_groups, moe_cfg.num_shared_experts)
  assert routing == ("sigmoid", True, 2.5, None, 1)
  assert moe_cfg.bias_update_rate > 0  # the layer keeps the checkpoint's bias


@pytest.mark.slow
def test_original_format_and_defaults_read_as_the_fixtures():
  """The original config.json (sarvamai/sarvam-105b's: num_experts and num_shared_experts for DeepSeek-V3's names,
  head_dim kv_lora_rank + qk_rope_head_dim, rope_scaling type 'deepseek_yarn', no q_lora_rank, n_group, topk_group
  nor first_k_dense_replace) reads as the fixture's, as SarvamMLAConfig converts it."""
  hf = config()
  rope = dict(hf.pop("rope_parameters"))
  legacy = {k: v for k, v in hf.items() if k not in ("q_lora_rank", "n_group", "topk_group", "first_k_dense_replace")}
  legacy["num_experts"], legacy["num_shared_experts"] = legacy.pop("n_routed_experts"), legacy.pop("n_shared_experts")
  legacy["head_dim"] = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
  legacy["rope_theta"] = rope.pop("rope_theta")
  legacy["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "deepseek_yarn"}
  assert hf_config.from_hf_config(legacy) == hf_config.from_hf_config(config())
  without = {k: v for k, v in config().items() if k != "num_nextn_predict_layers"}
  assert hf_config.from_hf_config({**without, "num_mtp_layers": 1})[0].num_mtp_layers == 1


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("moe_layers", (True, False, True)), ("moe.score", "softmax")])
def test_export_refuses_what_config_json_cannot_say(field, value):
  check_export_refuses(config(), field, value)
