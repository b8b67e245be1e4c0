"""Cheap checks before expensive work: a run whose init_from checkpoint has a truncated or missing safetensors file,
or whose data file cannot be read, is refused, naming the file, before a tokenizer is trained or loaded (the issue:
a corrupt safetensors file reported after 17.6 s of tokenizer training)."""

import gzip
import json
import shutil

import pytest

from configs import decoder
from moejax.train import inputs
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT
from tests.test_heldout import tiny_decoder_config

FIXTURE = ROOT / "tests" / "data" / "hf" / "qwen3_moe"


@pytest.fixture
def no_tokenizer(monkeypatch):
  monkeypatch.setattr(inputs.corpus_lib, "load_tokenizer", lambda *a: pytest.fail("the tokenizer came first"))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_broken_safetensors_file_is_reported_before_the_tokenizer(tmp_path, no_tokenizer, damage):
  checkpoint = tmp_path / "hf"
  shutil.copytree(FIXTURE, checkpoint)
  weights = checkpoint / "model.safetensors"
  if damage == "truncated":
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
  else:
    weights.unlink()
  (tmp_path / "c4.json").write_text(json.dumps({"text": "a document"}) + "\n")
  config = decoder.get_config(f"hf={checkpoint}")
  (tmp_path / "tokenizer.json").write_text(
    "{}"
  )  # named, as a checkpoint without one needs; never read: the weights fail first
  config.data.update(
    train_files=str(tmp_path / "c4.json"),
    cache_dir=str(tmp_path / "cache"),
    tokenizer_model=str(tmp_path / "tokenizer.json"),
  )
  match = "truncated or not safetensors" if damage == "truncated" else "no model.safetensors"
  with pytest.raises(ConfigError, match=match) as error:
    train.train(config, str(tmp_path / "run"))
  assert str(checkpoint) in str(error.value)


def test_an_unreadable_data_file_is_reported_before_the_tokenizer(shared, tmp_path, no_tokenizer):
  path = tmp_path / "c4-train.00000-of-00002.json.gz"
  with gzip.open(path, "wb") as f:
    f.write(b"".join(json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(100)))
  path.write_bytes(path.read_bytes()[:12])  # a download cut short inside the gzip header's stream
  (tmp_path / "c4-train.00001-of-00002.json").write_text(json.dumps({"text": "fine"}) + "\n")
  config = tiny_decoder_config(shared)
  config.data.train_files = str(tmp_path / "c4-train.*")
  with pytest.raises(ConfigError, match=f"data file {path} cannot be read"):
    train.train(config, str(tmp_path / "run"))
