"""Checks shared by the per-family Hugging Face test files (tests/test_hf_<family>.py and the files of several
families): a family's config.json and module-scoped model, its logits and routers' choices against the fixture's, its
greedy generation, its logits under tensor parallelism, the export's round trip, and what the export refuses. The
fixtures and their outputs (`reference`, `tiled`, `TOL`, `model_state`): tests/test_hf_models.py."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import moejax.infer as infer
import moejax.models as models
from moejax.models import hf_config
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests.helpers import relative_error
from tests.test_hf_models import DATA, TOL, assert_states_equal, model_state, reference, tiled

# config.json fields every family's export writes as the fixture has them
SHAPES = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers")


def config(family: str) -> dict:
  """The fixture's config.json."""
  return json.loads((DATA / family / "config.json").read_text())


def model_fixture(family: str):
  """A module-scoped `model` fixture: the family's fixture checkpoint on the 2 x 4 mesh (default MoE settings)."""

  @pytest.fixture(scope="module", name="model")
  def model(mesh_2x4):
    return models.from_hf(str(DATA / family), mesh_2x4)

  return model


def from_hf_under(family: str, mesh, moe: dict, **kwargs):
  """The family's fixture checkpoint under the MoE options `moe` (and from_hf's `kwargs`), which it keeps."""
  model = models.from_hf(str(DATA / family), mesh, moe=moe, **kwargs)
  assert all(getattr(model.moe_cfg, name) == value for name, value in moe.items())
  return model


def check_logits_and_routing(
  logits, aux, ref: dict, *, every_copy: bool = True, no_drops: bool = True, no_overflow: bool = False
) -> np.ndarray:
  """The forward's logits on the tiled fixture tokens are the fixture's (every copy of the batch, or the first only),
  the routers' choices (sorted per token) the fixture's, no token dropped (nor overflowed, `no_overflow`). Returns
  the sorted choices."""
  logits = np.asarray(logits)
  if every_copy:
    for copy in range(logits.shape[0] // 2):  # every copy of the batch, wherever its rows live on the mesh
      error = relative_error(logits[2 * copy : 2 * copy + 2], ref["logits"])
      assert error < TOL, (copy, error)
  else:
    assert relative_error(logits[:2], ref["logits"]) < TOL
  tokens = ref["router_ids"].shape[1]
  ids = np.sort(np.asarray(aux["expert_ids"])[:, :tokens], axis=-1)
  np.testing.assert_array_equal(ids, ref["router_ids"])
  if no_drops:
    assert np.all(np.asarray(aux["tokens_dropped"]) == 0)
  if no_overflow:
    assert np.all(np.asarray(aux["tokens_overflowed"]) == 0)
  return ids


def check_against_reference(model, ref: dict, **checks) -> np.ndarray:
  """`check_logits_and_routing` of the model's forward with details on the tiled fixture tokens."""
  logits, aux = model(tiled(ref["tokens"]), details=True)
  return check_logits_and_routing(logits, aux, ref, **checks)


def check_greedy_generation(model, family: str, **kwargs) -> None:
  """Greedy tokens through the cache from the fixture's prompt are transformers' (generate_tokens' `kwargs`)."""
  ref = reference(family)
  prompt, greedy = ref["prompt"], ref["greedy"]
  got = infer.generate_tokens(model, prompt, greedy.shape[1] - prompt.shape[1], **kwargs)
  np.testing.assert_array_equal(got, greedy)


def check_under_tensor_parallelism(family: str) -> None:
  """Heads split over 'gpu' (4 nodes x 2 GPUs): the first copy's logits stay transformers'."""
  model = models.from_hf(str(DATA / family), mesh_lib.make_mesh(4, 2), model=dict(tensor_parallel=True))
  ref = reference(family)
  logits = np.asarray(jax.jit(lambda t: model(t)[0])(tiled(ref["tokens"])))
  assert relative_error(logits[:2], ref["logits"]) < TOL


def exported(model, tmp_path, family: str) -> tuple[str, dict, dict, dict]:
  """(the export's directory, the fixture's tensors, the export's tensors, the export's config.json) of
  `models.to_hf(model)` under tmp_path."""
  out = str(tmp_path / "export")
  models.to_hf(model, out)
  fixture, written = load_file(DATA / family / "model.safetensors"), load_file(os.path.join(out, "model.safetensors"))
  return out, fixture, written, json.loads(open(os.path.join(out, "config.json")).read())


def assert_tensors_equal(written: dict, want: dict) -> None:
  """The same names, each tensor bit for bit with its dtype."""
  assert sorted(written) == sorted(want)
  for name, tensor in want.items():
    assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name


def assert_fields_equal(got: dict, want: dict, names) -> None:
  for name in names:
    assert got[name] == want[name], name


def assert_loads_as(directory: str, mesh, model) -> None:
  """The checkpoint in `directory` loads as the same parameters and state as `model`."""
  assert_states_equal(model_state(models.from_hf(directory, mesh)), model_state(model))


def check_round_trip(model, tmp_path, family: str, mesh, fields) -> tuple[dict, dict]:
  """The export holds the fixture's tensors bit for bit under the same names and the config.json `fields` as the
  fixture's config.json says them; loaded again, the same parameters. Returns the export's tensors and config.json."""
  out, fixture, written, got = exported(model, tmp_path, family)
  assert_tensors_equal(written, fixture)
  assert_fields_equal(got, config(family), fields)
  assert_loads_as(out, mesh, model)
  return written, got


def check_export_refuses(hf: dict, field: str, value) -> None:
  """The config read from `hf` with `field` (a DecoderConfig field, or 'moe.' and a MoEConfig field) set to `value`:
  to_hf_config refuses it, naming the field."""
  cfg, moe_cfg = hf_config.from_hf_config(hf)
  if field.startswith("moe."):
    moe_cfg = dataclasses.replace(moe_cfg, **{field[4:]: value})
  else:
    cfg = dataclasses.replace(cfg, **{field: value})
  with pytest.raises(ConfigError, match=field):
    hf_config.to_hf_config(cfg, moe_cfg)
