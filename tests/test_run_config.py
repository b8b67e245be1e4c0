"""A training workdir keeps its config (config.json: the resolved config, versions, history) and resumes only
itself: the issue's scenario (5 steps, then steps=7 with moe.top_k and the learning rate changed) refused before
anything is read or compiled, naming both fields; checkpoint.resume='continue' and 'branch'; harmless fields
(steps) resumed silently."""

import json
import subprocess

import jax
import pytest

import moejax
from moejax import run_config
from moejax.train import inputs, metrics, resume
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT
from tests.test_heldout import tiny_decoder_config


def _config(shared, steps, **checkpoint):
  config = tiny_decoder_config(shared)
  config.steps = steps
  config.checkpoint.update(every_steps=steps, **checkpoint)
  config.log.eval_every = 0
  return config


def _changed(config):
  config.moe.top_k = 2
  config.optim.learning_rate = 0.1
  return config


def _steps(workdir):
  return [r["step"] for r in metrics.read_jsonl(str(workdir / "metrics.jsonl"))]


def _stored(workdir):
  return json.loads((workdir / run_config.CONFIG_FILE).read_text())


@pytest.mark.slow  # four short runs (about 50 s on 2 cores)
def test_a_changed_config_is_refused_unless_continued_or_branched(shared, tmp_path, monkeypatch):
  run, branch = tmp_path / "q", tmp_path / "q_topk2"
  train.train(_config(shared, 5), str(run))
  stored = _stored(run)
  assert stored["steps"] == 5 and stored["moe"]["top_k"] == 4 and stored["history"] == []
  head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  assert stored["versions"]["git"].startswith(head) and stored["versions"]["jax"] == jax.__version__
  assert stored["versions"]["moejax"] == moejax.__version__

  with monkeypatch.context() as m:  # refused before the tokenizer is loaded, so before anything is compiled
    m.setattr(inputs.corpus_lib, "load_tokenizer", lambda *a: pytest.fail("read the data before refusing"))
    with pytest.raises(ConfigError, match="resume") as refused:
      train.train(_changed(_config(shared, 7)), str(run))
  message = str(refused.value)
  assert "moe.top_k 4 -> 2" in message and "optim.learning_rate 0.003 -> 0.1" in message
  assert "steps 5 -> 7" not in message  # a harmless field is not named
  assert _steps(run) == [1, 2, 3, 4, 5] and _stored(run) == stored

  train.train(_changed(_config(shared, 7, resume="branch", branch_dir=str(branch))), str(run))
  assert _steps(run) == [1, 2, 3, 4, 5] and _stored(run) == stored  # the original is left as it was
  assert _steps(branch) == [1, 2, 3, 4, 5, 6, 7]
  [entry] = _stored(branch)["history"]
  assert entry["step"] == 5 and entry["resume"] == "branch" and entry["from"] == str(run)
  assert entry["changed"]["moe.top_k"] == [4, 2] and entry["changed"]["optim.learning_rate"] == [0.003, 0.1]

  train.train(_changed(_config(shared, 7, resume="continue")), str(run))
  assert _steps(run) == [1, 2, 3, 4, 5, 6, 7]
  [entry] = _stored(run)["history"]
  assert entry["resume"] == "continue" and entry["changed"]["steps"] == [5, 7]
  assert entry["versions"] == stored["versions"]
  continued = metrics.read_jsonl(str(run / "metrics.jsonl"))[5:]
  branched = metrics.read_jsonl(str(branch / "metrics.jsonl"))[5:]
  assert [r["loss"] for r in continued] == [r["loss"] for r in branched]  # the same state and data position

  # Only steps (and the resume mode) differ from config.json now: resumed without a word.
  train.train(_changed(_config(shared, 8)), str(run))
  assert _steps(run) == list(range(1, 9))
  assert _stored(run)["history"][-1]["changed"] == {
    "steps": [7, 8],
    "checkpoint.every_steps": [7, 8],
    "checkpoint.resume": ["continue", "same"],
  }


def _fake_run(directory, config):
  """A workdir as the trainer leaves it after a checkpoint at step 5 (its arrays are not read here)."""
  (directory / "checkpoints" / "5").mkdir(parents=True)
  (directory / run_config.CONFIG_FILE).write_text(
    json.dumps({**json.loads(run_config.dumps(config)), "versions": {}, "history": []})
  )


def test_the_issues_changed_config_is_refused_before_anything_is_read(shared, tmp_path, monkeypatch):
  """The issue's scenario on a workdir as a 5-step run leaves it: steps=7 with moe.top_k and the learning rate
  changed is refused by `train` before the tokenizer is loaded (so before anything is compiled)."""
  _fake_run(tmp_path, _config(shared, 5))
  monkeypatch.setattr(inputs.corpus_lib, "load_tokenizer", lambda *a: pytest.fail("read the data before refusing"))
  with pytest.raises(ConfigError, match="checkpoint.resume=continue") as refused:
    train.train(_changed(_config(shared, 7)), str(tmp_path))
  message = str(refused.value)
  assert "moe.top_k 4 -> 2, optim.learning_rate 0.003 -> 0.1. Set" in message


def test_harmless_fields_pass_and_every_other_difference_is_named(shared, tmp_path):
  config = _config(shared, 5)
  _fake_run(tmp_path, config)
  harmless = _config(shared, 9)
  harmless.log.update(every_steps=3, eval_every=4)
  harmless.checkpoint.update(keep=1, use_async=True)
  harmless.data.prefetch = 0
  assert resume.prepare(harmless, str(tmp_path), say=print) == (str(tmp_path), None)
  other = _config(shared, 5)
  other.data.heldout_every = 20  # another split: other data
  other.model.num_heads = 2
  with pytest.raises(ConfigError, match=r"this one: model.num_heads 4 -> 2, data.heldout_every 50 -> 20\. Set"):
    resume.prepare(other, str(tmp_path), say=print)


def test_resume_fields_are_checked(shared):
  from moejax.train import config as config_lib

  for fields, match in (
    ({"resume": "fork"}, "checkpoint.resume"),
    ({"resume": "branch"}, "checkpoint.branch_dir"),
    ({"branch_dir": "/tmp/x"}, "checkpoint.branch_dir"),
  ):
    config = _config(shared, 5)
    config.checkpoint.update(fields)
    with pytest.raises(ConfigError, match=match):
      config_lib.checked(config)
