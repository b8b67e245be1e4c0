"""The trainer's own workdir guard (issue 61, `moejax.workdir_guard`): training into a workdir that holds an export, a
sweep or another program's outputs (or branching into one) is refused with one line naming what is there and the fix,
before anything is read or written; the trainer's own run, and a fresh or unrecognised directory, go on."""

import json
import subprocess
import sys

import pytest

from moejax import run_config, workdir_guard
from moejax.train import inputs
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env
from tests.test_heldout import tiny_decoder_config


class _PastTheGuard(Exception):
  """Raised where training would load its tokenizer: the run got past the workdir checks."""


@pytest.fixture
def no_tokenizer(monkeypatch):
  def stop(*args):
    raise _PastTheGuard

  monkeypatch.setattr(inputs.corpus_lib, "load_tokenizer", stop)


def _export(directory):
  directory.mkdir()
  (directory / run_config.CONFIG_FILE).write_text("{}")
  (directory / "model.safetensors").write_bytes(b"")
  return directory


def _sweep(directory):
  directory.mkdir()
  (directory / "points.jsonl").write_text("")
  return directory


def _marked(directory, program):
  directory.mkdir()
  (directory / workdir_guard.MARKER).write_text(json.dumps({"program": program, "settings": None}))
  return directory


def _fake_run(directory, config):
  """A workdir as the trainer leaves it after a checkpoint at step 5 (its arrays are not read here)."""
  (directory / "checkpoints" / "5").mkdir(parents=True)
  stored = {**json.loads(run_config.dumps(config)), "versions": {}, "history": []}
  (directory / run_config.CONFIG_FILE).write_text(json.dumps(stored))
  return stored


def _refusal(workdir, what):
  return f"{workdir} holds the outputs of {what}: use another --workdir for experiments.train"


@pytest.mark.parametrize(
  "make,what",
  [
    (_export, "a Hugging Face export (experiments.export)"),
    (_sweep, "a scaling sweep (experiments.scaling)"),
    (lambda d: _marked(d, "experiments.convergence"), "experiments.convergence"),
  ],
)
def test_training_into_another_programs_outputs_is_refused(shared, tmp_path, no_tokenizer, make, what):
  workdir = make(tmp_path / "out")
  before = sorted(p.name for p in workdir.iterdir())
  with pytest.raises(ConfigError) as refused:
    train.train(tiny_decoder_config(shared), str(workdir))
  assert str(refused.value) == _refusal(workdir, what)
  assert sorted(p.name for p in workdir.iterdir()) == before  # nothing written


def test_branching_into_an_export_is_refused(shared, tmp_path, no_tokenizer):
  config = tiny_decoder_config(shared)
  run = tmp_path / "run"
  _fake_run(run, config)
  export = _export(tmp_path / "hf")
  config.checkpoint.update(resume="branch", branch_dir=str(export))
  with pytest.raises(ConfigError) as refused:
    train.train(config, str(run))
  assert str(refused.value) == _refusal(export, "a Hugging Face export (experiments.export)")
  assert not (export / "checkpoints").exists()


@pytest.mark.slow
def test_the_trainers_own_run_and_a_fresh_directory_go_on(shared, tmp_path, no_tokenizer):
  config = tiny_decoder_config(shared)
  for workdir in (tmp_path / "fresh", tmp_path / "other"):
    (tmp_path / "other").mkdir(exist_ok=True)
    (tmp_path / "other" / "notes.txt").write_text("not a program's output")
    with pytest.raises(_PastTheGuard):
      train.train(config, str(workdir))
  run = tmp_path / "run"
  _fake_run(run, config)
  with pytest.raises(_PastTheGuard):
    train.train(config, str(run))


def test_a_run_from_before_the_train_section_resumes(shared, tmp_path, no_tokenizer):
  """Its config.json lacks train.*: the defaults (no spike guard) are what it ran with, so it resumes."""
  config = tiny_decoder_config(shared)
  stored = _fake_run(tmp_path, config)
  del stored["train"]
  (tmp_path / run_config.CONFIG_FILE).write_text(json.dumps(stored))
  with pytest.raises(_PastTheGuard):
    train.train(config, str(tmp_path))
  config.train.loss_spike_factor = 3.0  # a spike guard it never had is a change
  with pytest.raises(ConfigError, match=r"train.loss_spike_factor '\(absent\)' -> 3.0"):
    train.train(config, str(tmp_path))


@pytest.mark.slow
def test_experiments_train_refuses_an_export_with_one_line_and_status_1(tmp_path):
  export = _export(tmp_path / "hf")
  done = subprocess.run(
    [sys.executable, "-m", "experiments.train", "--config=configs/mlm.py", f"--workdir={export}"],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  want = f"error: {_refusal(export, 'a Hugging Face export (experiments.export)')}"
  assert done.returncode == 1 and errors == [want] and "Traceback" not in done.stderr, done.stderr[-2000:]
