"""Granite MoE with a shared MLP (`granitemoeshared`) against transformers: granitemoe's decoder with, beside each
MoE block, an ungated SwiGLU whose gate and up rows share one Linear (`shared_mlp.input_linear.weight` [2s, d], read
as two blocks of its rows: `hf_parts.block(..., axis=0)`). The fixture (tests/data/hf/granitemoeshared, transformers'
GraniteMoeSharedForCausalLM: granitemoe's fixture with a shared MLP of width 24) gives logits on the 2 x 4 mesh
scanned and unrolled under another MoE path, the checkpoint written back bit for bit (the rows joined again); without
the shared MLP the logits are others. Its export loads back in transformers with the fixture's logits
(`make_hf_fixtures.py --check-export granitemoeshared`, docs/models.md)."""

import functools
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moejax.models as models
from tests import hf_family_checks as checks
from tests.helpers import relative_error
from tests.hf_family_checks import SHAPES, check_against_reference, check_round_trip, from_hf_under
from tests.test_hf_models import fixture_copy, group, reference, tiled

FAMILY = "granitemoeshared"
pytestmark = group(FAMILY)
model = checks.model_fixture(FAMILY)
config = functools.partial(checks.config, FAMILY)


@pytest.mark.slow
def test_logits_and_routing_match_transformers(model):
  assert (model.moe_cfg.num_shared_experts, model.moe_cfg.shared_d_ff, model.moe_cfg.shared_gate) == (1, 24, False)
  check_against_reference(model, reference(FAMILY))


@pytest.mark.slow
def test_logits_unrolled_under_another_path(mesh_2x4):
  other = from_hf_under(FAMILY, mesh_2x4, {"path": "gpu_first", "collective": "capacity", "capacity_factor": 8.0})
  check_against_reference(other, reference(FAMILY))


@pytest.mark.slow
def test_round_trip(model, tmp_path, mesh_2x4):
  check_round_trip(model, tmp_path, FAMILY, mesh_2x4, SHAPES + ("shared_intermediate_size", "num_local_experts"))


@pytest.mark.slow
def test_the_shared_mlp_acts(tmp_path, mesh_2x4):
  """The control: the shared MLP's output rows zeroed, and the logits are others."""
  ref = reference(FAMILY)
  directory = fixture_copy(tmp_path, FAMILY)
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  save_file({k: np.zeros_like(v) if "shared_mlp.output" in k else v for k, v in tensors.items()}, path)
  logits = np.asarray(models.from_hf(directory, mesh_2x4)(tiled(ref["tokens"]), details=True)[0])[:2]
  assert relative_error(logits, ref["logits"]) > 1e-3
