"""The fixtures' tokenizers (tests/fixtures/make_hf_fixtures.py --tokenizers: a tokenizer.json of one token per
character over exactly the checkpoint's vocab_size ids, with the special tokens config.json names) read by moejax's
tokenizer loading, and a fixture fine-tuned through it as docs/training.md's command does."""

import json
import subprocess
import sys

import numpy as np
import pytest

from moejax.data import tokenizer as tokenizer_lib
from tests.helpers import ROOT, cpu_env

DATA = ROOT / "tests" / "data" / "hf"
FIXTURES = sorted(p.name for p in DATA.iterdir() if (p / "config.json").exists())


def decoder_config(name: str) -> dict:
  """A fixture's config.json; a vision-language model's with its text_config's fields under its own (an omni model's
  thinker's)."""
  config = json.loads((DATA / name / "config.json").read_text())
  config = {**config.get("thinker_config", {}), **config}  # Qwen3-Omni's: its thinker's
  return {**(config.get("text_config") or {}), **config}


def load(name: str):
  vocab = decoder_config(name)["vocab_size"]
  return tokenizer_lib.load_or_train(str(DATA / name / "tokenizer.json"), "", vocab, "", lambda: [])


@pytest.mark.parametrize("name", FIXTURES)
def test_each_fixture_has_a_tokenizer_over_its_vocabulary(name):
  config = decoder_config(name)
  meta = json.loads((DATA / name / "meta.json").read_text())
  assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
  tok = load(name)
  assert tok.num_ids == config["vocab_size"]
  if config.get("eos_token_id") is not None:  # the checkpoint's own end of sequence
    assert tok.eos_id == config["eos_token_id"]
  text = "Mixture of experts, routed: 42 tokens!"
  ids = tok.encode(text)
  assert len(ids) == len(text) and all(0 <= i < config["vocab_size"] for i in ids)
  assert tok.decode(ids) == text


@pytest.mark.slow
def test_a_fixture_fine_tunes_with_its_tokenizer_from_the_command_line(tmp_path, devices):
  """experiments.train --config=configs/decoder.py:hf=DIR on the fixture directory itself, two steps: the checkpoint's
  tokenizer is the one the run reads (not one trained on the corpus), and the losses are finite."""
  fixture = DATA / "mixtral"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--config=configs/decoder.py:hf={fixture}",
      f"--workdir={tmp_path}",
      "--config.steps=2",
      "--config.batch_size=8",
      "--config.micro_batches=1",
      "--config.seq_len=16",
      "--config.log.every_steps=1",
      "--config.checkpoint.every_steps=2",
    ],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"tokenizer with {load('mixtral').num_ids} ids" in result.stdout
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [r["task_loss"] for r in records if "task_loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses)), losses
