"""Checkpoints as transformers saves them (issue 52): a DeepSeek-V3 config.json naming an MTP layer whose tensors
save_pretrained did not write loads without it (for inference) or with fresh MTP modules (fine-tuning with MTP), each
said in the log; its logits, routing and greedy tokens against transformers are in tests/test_hf_models.py."""

import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx

import moejax.models as models
from moejax.models import hf_config, hf_load
from moejax.models import state as state_lib
from tests.helpers import ROOT, relative_error

DATA = ROOT / "tests" / "data" / "hf"
NO_MTP = DATA / "deepseek_v3_no_mtp"


def host(tree):
  return jax.tree.map(np.asarray, tree)


def test_no_mtp_checkpoint_loads_without_mtp_and_says_so(mesh_2x4, caplog):
  with caplog.at_level(logging.INFO):
    model = models.from_hf(str(NO_MTP), mesh_2x4)
  assert model.cfg.num_mtp_layers == 0 and len(model.mtp) == 0
  lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
  assert len(lines) == 1 and "no MTP tensors" in lines[0] and "model.layers.3" in lines[0]


@pytest.mark.slow
def test_fine_tuning_with_mtp_initialises_the_modules(mesh_2x4, caplog):
  """The trainer's init_from path (load_state with the checkpoint's config, one MTP module): the blocks are the
  checkpoint's (those of deepseek_v3, the same tensors), the MTP module its initialisation, and the log says so."""
  cfg, moe_cfg = hf_config.from_hf_config(json.loads((NO_MTP / "config.json").read_text()))
  assert cfg.num_mtp_layers == 1
  with caplog.at_level(logging.INFO):
    _, params, _ = hf_load.load_state(str(NO_MTP), cfg, moe_cfg, mesh_2x4, seed=3)
  assert any("initialisation" in r.getMessage() and "MTP" in r.getMessage() for r in caplog.records)
  fresh, _ = state_lib.init_state(cfg, moe_cfg, mesh_2x4, seed=3)
  jax.tree.map(np.testing.assert_array_equal, host(params["mtp"]), host(fresh["mtp"]))
  full = nnx.to_pure_dict(nnx.state(models.from_hf(str(DATA / "deepseek_v3"), mesh_2x4), nnx.Param))
  for key in ("embed", "segments", "norm", "lm_head"):
    jax.tree.map(np.testing.assert_array_equal, host(params[key]), host(full[key]))
  assert not np.array_equal(np.asarray(params["embed"]["embedding"]), np.asarray(fresh["embed"]["embedding"]))


def test_any_batch_forward(mesh_2x4):
  """A batch of 2 on the 8 devices (the model's call pads and cuts, as generate_tokens pads): transformers' logits; one row alone
  the same row's."""
  ref = np.load(DATA / "qwen3_moe" / "reference.npz")
  model = models.from_hf(str(DATA / "qwen3_moe"), mesh_2x4)
  logits, _ = model(ref["tokens"])
  assert logits.shape == ref["logits"].shape
  assert relative_error(np.asarray(logits), ref["logits"]) < 1e-4
  one, _ = model(ref["tokens"][1:])
  assert relative_error(np.asarray(one), ref["logits"][1:]) < 1e-4
