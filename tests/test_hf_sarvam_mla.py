"""Sarvam-MLA (`sarvam_mla`) against transformers: DeepSeek-V3's decoder under its own model_type (transformers runs
it as DeepseekV3ForCausalLM), MLA without q LoRA, one routing group, one dense layer first (SarvamMLAConfig's
defaults). The fixture (tests/data/hf/sarvam_mla: 3 layers, MoE in 1 and 2, 16 experts top-4, a shared expert, YaRN)
gives logits on the 2 x 4 mesh scanned and unrolled under another MoE path, the routers' choices, greedy tokens
through the cache, and the checkpoint written back bit for bit; the export loads back in transformers with the
fixture's logits (`make_hf_fixtures.py --check-export sarvam_mla`, docs/models.md). Here too the original config.json
format SarvamMLAConfig converts (its aliases, head_dim, rope_scaling 'deepseek_yarn')."""

import dataclasses
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import moejax.infer as infer
import moejax.models as models
from moejax.models import hf_config
from moejax.validation import ConfigError
from tests.helpers import relative_error
from tests.test_hf_models import DATA, TOL, assert_states_equal, group, model_state, reference, tiled

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


def config() -> dict:
  return json.loads((DATA / FAMILY / "config.json").read_text())


@pytest.fixture(scope="module")
def model(mesh_2x4):
  return models.from_hf(str(DATA / FAMILY), mesh_2x4)


def check_against_reference(model, ref):
  logits, aux = model(tiled(ref["tokens"]), details=True)
  logits = np.asarray(logits)
  errors = [relative_error(logits[2 * c : 2 * c + 2], ref["logits"]) for c in range(logits.shape[0] // 2)]
  assert max(errors) < TOL, errors  # every copy of the batch, wherever its rows live on the mesh
  tokens = ref["router_ids"].shape[1]
  ids = np.sort(np.asarray(aux["expert_ids"])[:, :tokens], axis=-1)
  np.testing.assert_array_equal(ids, ref["router_ids"])
  assert np.all(np.asarray(aux["tokens_dropped"]) == 0)


def test_logits_and_routing_match_transformers(model):
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = models.from_hf(str(DATA / FAMILY), mesh_2x4, moe=OTHER_PATH, model={"scan_layers": False})
  assert all(getattr(other.moe_cfg, name) == value for name, value in OTHER_PATH.items())
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  ref = reference(FAMILY)
  prompt, greedy = ref["prompt"], ref["greedy"]
  np.testing.assert_array_equal(infer.generate_tokens(model, prompt, greedy.shape[1] - prompt.shape[1]), greedy)


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  """The export is sarvam_mla run as DeepseekV3ForCausalLM, holds the fixture's tensors bit for bit under the same
  names, and the config.json fields transformers reads; loaded again, the same parameters."""
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  fixture, written = load_file(DATA / FAMILY / "model.safetensors"), load_file(os.path.join(out, "model.safetensors"))
  assert sorted(written) == sorted(fixture)
  for name, tensor in fixture.items():
    assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name
  want, got = config(), json.loads(open(os.path.join(out, "config.json")).read())
  for name in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers") + FIELDS:
    assert got[name] == want[name], name
  assert (got["model_type"], got["architectures"]) == ("sarvam_mla", ["DeepseekV3ForCausalLM"])
  assert_states_equal(model_state(models.from_hf(out, mesh_2x4)), model_state(model))


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
  cfg, moe_cfg = hf_config.from_hf_config(config())
  if field.startswith("moe."):
    moe_cfg = dataclasses.replace(moe_cfg, **{field[4:]: value})
  else:
    cfg = dataclasses.replace(cfg, **{field: value})
  with pytest.raises(ConfigError, match=field):
    hf_config.to_hf_config(cfg, moe_cfg)
