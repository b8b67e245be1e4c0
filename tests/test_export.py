"""experiments/export.py: a trained tiny decoder's workdir written as a Hugging Face checkpoint that moejax's
from_hf loads back to the same logits, with ordinary file modes; runs without a Hugging Face form refused."""

import os
import subprocess
import sys

import numpy as np
import pytest

from configs import mlm
from experiments import export
from moejax import run_config
from moejax.infer import load
from moejax.models import hf_load
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env
from tests.test_heldout import tiny_decoder_config, tiny_decoder_run


@pytest.mark.slow  # the 3-step run of tests/test_heldout.py (shared), then two forward passes
def test_an_exported_run_loads_back_to_the_same_logits(shared, tmp_path, mesh_2x4):
  run = tiny_decoder_run(shared)
  out = tmp_path / "hf"
  assert export.export(str(run), str(out)) == 3
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  umask = os.umask(0)
  os.umask(umask)
  for name in os.listdir(out):
    assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~umask  # not safetensors' own 0600
  trained, _, step = load.load_trained(tiny_decoder_config(shared), str(run))
  loaded = hf_load.from_hf(str(out), mesh_2x4)
  tokens = np.random.default_rng(0).integers(3, 200, (8, 16)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(loaded(tokens)[0]), np.asarray(trained(tokens)[0]), rtol=1e-5, atol=1e-5)


def test_runs_without_a_hugging_face_form_are_refused(tmp_path):
  with pytest.raises(ConfigError, match="config.json"):
    export.training_config(str(tmp_path))
  (tmp_path / run_config.CONFIG_FILE).write_text(run_config.dumps(mlm.get_config()))
  done = subprocess.run(
    [sys.executable, "-m", "experiments.export", f"--config.run={tmp_path}", f"--workdir={tmp_path / 'hf'}"],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
  )
  assert done.returncode == 1 and not (tmp_path / "hf").exists()
  assert done.stderr.strip().splitlines()[-1] == (
    f"error: config field run='{tmp_path}' is not allowed: a run of a decoder family (configs/decoder.py): its model "
    "kind 'bert' (SMILE's BERT / GPT) has no Hugging Face form"
  )
