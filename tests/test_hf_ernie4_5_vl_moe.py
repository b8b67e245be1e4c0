"""ERNIE-4.5-VL (`ernie4_5_vl_moe`) against transformers' Ernie4_5_VLMoeForConditionalGeneration given input_ids
alone: ERNIE-4.5-MoE's decoder of text_config whose MoE layers hold text experts beside vision experts, a text token
routed among the text ones. The fixture (tests/data/hf/ernie4_5_vl_moe, transformers' own class with a 1-layer vision
tower and resampler, saved as published: the text router transposed, the statics' bias [2, E], the vision experts
numbered after the text ones) gives logits on the 2 x 4 mesh under the default MoE path and another, the routers'
choices and greedy tokens; the export is the decoder alone as ERNIE-4.5-MoE's checkpoint, which loads back in moejax
with the same parameters and in transformers with the fixture's logits (`make_hf_fixtures.py --check-export
ernie4_5_moe`, docs/models.md)."""

import functools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moejax.models import hf_config
from moejax.validation import ConfigError
from tests import hf_family_checks as checks
from tests.hf_family_checks import (
  assert_loads_as,
  assert_tensors_equal,
  check_against_reference,
  check_greedy_generation,
  exported,
  from_hf_under,
)
from tests.test_hf_models import fixture_copy, group, reference, refused

FAMILY = "ernie4_5_vl_moe"
OTHER_PATH = {"path": "gpu_first", "collective": "capacity", "capacity_factor": 8.0}
EXPERTS = 8
pytestmark = group(FAMILY)


config = functools.partial(checks.config, FAMILY)
model = checks.model_fixture(FAMILY)


def test_logits_and_routing_match_transformers(model):
  """The text experts' width, the dense first layer by mlp_layer_types, the text row of the bias; the multimodal
  RoPE on text is ERNIE-4.5's interleaved one. The vision experts, router, tower and resampler are in the checkpoint
  and ignored."""
  cfg, moe_cfg = model.cfg, model.moe_cfg
  assert (cfg.moe_layers, cfg.rope_interleaved, cfg.tie_embeddings) == ((False, True, True), True, True)
  assert (moe_cfg.d_ff, moe_cfg.num_experts, moe_cfg.num_shared_experts, moe_cfg.shared_width) == (16, 8, 1, 16)
  stored = load_file(checks.DATA / FAMILY / "model.safetensors")
  assert stored["model.layers.1.mlp.gate.weight"].shape == (32, EXPERTS)  # [d, E]: transposed
  assert stored["model.layers.1.mlp.experts.8.gate_proj.weight"].shape == (8, 32)  # a vision expert
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_under_another_path(mesh_2x4):
  check_against_reference(from_hf_under(FAMILY, mesh_2x4, OTHER_PATH), reference(FAMILY))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(model):
  check_greedy_generation(model, FAMILY)


def _as_text_only(fixture: dict) -> dict:
  """The fixture's decoder tensors as Ernie4_5_MoeForCausalLM's checkpoint holds them: the text router [E, d], the
  bias's text row [1, E], the text experts alone; no vision tensor."""
  out = {}
  for name, tensor in fixture.items():
    if name.startswith(("model.vision_model.", "model.resampler_model.")) or name.endswith(".gate.weight_1"):
      continue
    if ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= EXPERTS:
      continue
    if name.endswith(".mlp.gate.weight"):
      tensor = np.ascontiguousarray(tensor.T)
    elif name.endswith(".moe_statics.e_score_correction_bias"):
      tensor = tensor[:1]
    out[name] = tensor
  return out


@pytest.mark.slow
def test_export_is_the_text_only_decoder(model, tmp_path, mesh_2x4):
  """The export is ERNIE-4.5-MoE's checkpoint of the decoder: the fixture's text tensors bit for bit (the router and
  bias in that class's layout), config.json flat with the MoE layers as start and interval; loaded back, the same
  parameters."""
  out, fixture, written, got = exported(model, tmp_path, FAMILY)
  assert_tensors_equal(written, _as_text_only(fixture))
  assert (got["model_type"], got["architectures"]) == ("ernie4_5_moe", ["Ernie4_5_MoeForCausalLM"])
  assert (got["moe_layer_start_index"], got["moe_layer_interval"], got["moe_intermediate_size"]) == (1, 1, 16)
  assert "text_config" not in got and got["tie_word_embeddings"] is True
  assert_loads_as(out, mesh_2x4, model)


@pytest.mark.slow
def test_only_the_vision_experts_are_ignored(tmp_path, mesh_2x4):
  """Experts numbered E .. 2E - 1 are the vision ones, ignored; one numbered 2E is refused, naming it."""
  directory = fixture_copy(tmp_path, FAMILY)
  path = os.path.join(directory, "model.safetensors")
  extra = f"model.layers.1.mlp.experts.{2 * EXPERTS}.down_proj.weight"
  save_file({**load_file(path), extra: np.ones((32, 8), np.float32)}, path)
  assert extra in refused(directory, mesh_2x4)


@pytest.mark.slow
def test_reads_what_transformers_reads():
  """What text_config leaves out is Ernie4_5_VLMoeTextConfig's default (the first layer dense, the rest MoE); a
  moe_intermediate_size that is not the pair, or no text_config, is refused by name."""
  hf = config()
  text = {k: v for k, v in hf["text_config"].items() if k != "mlp_layer_types"}
  cfg, _ = hf_config.from_hf_config({**hf, "text_config": text})
  assert cfg.moe_layers == (False, True, True)
  for widths in (16, [16], [16, "8"]):
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
      hf_config.from_hf_config({**hf, "text_config": {**text, "moe_intermediate_size": widths}})
  with pytest.raises(ConfigError, match="text_config"):
    hf_config.from_hf_config({k: v for k, v in hf.items() if k != "text_config"})
