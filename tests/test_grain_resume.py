"""A grain-fed training run (moejax.data.pipeline) resumed from its checkpoint trains on the same batches to the same
losses, bit for bit, as the run that never stopped: in one process, and in two (gloo, 2 x 4). The data are two Parquet
files, so the run reads a non-default source, 8 shards by record, with documents cut across rows."""

import json
import subprocess
import sys

import numpy as np
import pytest

from configs import decoder
from moejax.train import metrics
from moejax.train import trainer as train
from tests.helpers import ENV, ROOT

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
# configs/decoder.py's tiny Qwen3-MoE cut to one MoE layer, 8 x 32 tokens a step, a checkpoint every 2 steps.
OVERRIDES = {
  "batch_size": 8,
  "micro_batches": 1,
  "seq_len": 32,
  "model.num_layers": 1,
  "model.moe_layers": (True,),
  "data.tokenizer_train_chars": 50_000,
  "checkpoint.every_steps": 2,
  "checkpoint.use_async": False,
  "log.every_steps": 1,
  "log.tensorboard": False,
  "log.eval_every": 0,
}


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory):
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  directory = tmp_path_factory.mktemp("parquet")
  rng = np.random.default_rng(0)
  files = []
  for i in range(2):
    texts = [" ".join(rng.choice(WORDS, rng.integers(5, 80))) for _ in range(300)]
    files.append(str(directory / f"part-{i}.parquet"))
    pq.write_table(pa.table({"text": texts}), files[-1], row_group_size=50)
  return ",".join(files)


def _config(files, cache, steps):
  config = decoder.get_config()
  config.steps = steps
  for field, value in {**OVERRIDES, "data.train_files": files, "data.cache_dir": str(cache)}.items():
    section, _, name = field.rpartition(".")
    (config[section] if section else config)[name] = value
  return config


def _losses(workdir):
  records = metrics.read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, len(records) + 1))
  return [r["loss"] for r in records]


def _data_state(workdir, step):
  """The data state (one dict per shard) checkpoint `step` holds."""
  meta = json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
  return meta["data"]["data"]


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_same_batches_to_the_same_losses(parquet_files, tmp_path):
  whole, halves = tmp_path / "whole", tmp_path / "halves"
  train.train(_config(parquet_files, tmp_path / "cache", 4), str(whole))
  train.train(_config(parquet_files, tmp_path / "cache", 2), str(halves))
  summary = train.train(_config(parquet_files, tmp_path / "cache", 4), str(halves))
  assert summary["resumed_from"] == 2
  state = _data_state(halves, 2)
  assert len(state) == 8 and any(s[4] > 0 for s in state)  # 8 shards, some inside a document (its offset, STATE_FIELDS)
  assert _data_state(halves, 4) == _data_state(whole, 4)
  want = _losses(whole)
  assert len(want) == 4 and len(set(want)) == 4  # new batches every step
  assert _losses(halves) == want  # exactly


def _launch(workdir, files, cache, steps):
  overrides = [
    f"--config.{k}={v}"
    for k, v in {**OVERRIDES, "steps": steps, "data.train_files": files, "data.cache_dir": cache}.items()
  ]
  command = [
    sys.executable,
    "-m",
    "moejax.runtime.launch",
    "--processes",
    "2",
    "--devices-per-process",
    "4",
    "--",
    sys.executable,
    "-m",
    "experiments.train",
    "--config=configs/decoder.py",
    f"--workdir={workdir}",
    *overrides,
  ]
  done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
  assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]


@pytest.mark.slow  # three two-process runs (about 1 min on 2 cores)
def test_two_processes_resume_bit_identically(parquet_files, tmp_path):
  whole, halves = tmp_path / "whole", tmp_path / "halves"
  _launch(whole, parquet_files, tmp_path / "cache", 4)
  _launch(halves, parquet_files, tmp_path / "cache", 2)
  _launch(halves, parquet_files, tmp_path / "cache", 4)
  assert json.loads((halves / "summary.json").read_text())["resumed_from"] == 2
  assert _data_state(halves, 4) == _data_state(whole, 4)
  want = _losses(whole)
  assert len(want) == 4 and len(set(want)) == 4
  assert _losses(halves) == want
