"""Held-out evaluation during training (moejax.train.heldout): the split never trained on, the loss in the records
against an independent evaluation of the checkpoint, the console line's held-out loss, unigram baseline, steps/s and
ETA, and the summary's baseline sentence."""

import contextlib
import json

import numpy as np
import pytest

from configs import decoder
from moejax.data import corpus as data
from moejax.data import pipeline, tokenizer
from moejax.data.tokenizer import cache_lock
from moejax.train import metrics
from moejax.train import trainer as train
from moejax.validation import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def tiny_decoder_config(shared):
  """configs/decoder.py's tiny Qwen3-MoE cut to one MoE layer, 3 steps of 8 x 32 tokens, held-out loss after
  step 2 and the last (2 batches)."""
  config = decoder.get_config()
  config.update(steps=3, batch_size=8, micro_batches=1, seq_len=32)
  config.model.update(num_layers=1, moe_layers=(True,))
  config.data.update(cache_dir=str(shared / "cache"), tokenizer_train_chars=100_000)
  config.checkpoint.update(every_steps=3, use_async=False)
  config.log.update(every_steps=1, tensorboard=False, eval_every=2, eval_batches=2)
  return config


def tiny_decoder_run(shared):
  """The workdir of `tiny_decoder_config` trained once per session; its console output in <workdir>/console."""
  workdir = shared / "tiny-decoder-eval"
  with cache_lock(str(shared / "locks" / "tiny-decoder-eval")):
    if not (workdir / "done").exists():
      workdir.mkdir(parents=True, exist_ok=True)
      with open(workdir / "console", "w") as out, contextlib.redirect_stdout(out):
        train.train(tiny_decoder_config(shared), str(workdir))
      (workdir / "done").touch()
  return workdir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(WORDS, 20)) for _ in range(500)]
  return tokenizer.load_or_train("", str(tmp_path_factory.mktemp("tok")), 64, "words", lambda: texts)


def test_the_heldout_split_is_never_trained_on_and_packs_every_kth_document(tmp_path, tok):
  texts = [f"document {i} " + " ".join(WORDS[: 1 + i % len(WORDS)]) for i in range(60)]
  path = tmp_path / "c4.json"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  k = 5
  held = texts[k - 1 :: k]
  expected = np.concatenate([tok.encode(t) + [tok.eos_id] for t in held])
  got = pipeline.heldout_tokens([str(path)], tok, k, batches=2, rows=3, seq_len=8)
  assert got.shape == (2, 3, 8)
  np.testing.assert_array_equal(got.reshape(-1), expected[:48])
  # Training over 4 line-sharded shards: shard s packs the kept documents s, s + 4, ... (none held out).
  kept = [t for i, t in enumerate(texts) if i % k != k - 1]
  for shard in range(4):
    want = np.concatenate([tok.encode(t) + [tok.eos_id] for t in kept[shard::4]])
    rows = iter(pipeline.packed_shard([str(path)], tok.encode, tok.eos_id, 8, shard, 4, heldout_every=k))
    got = np.concatenate([next(rows) for _ in range(len(want) // 8)])
    np.testing.assert_array_equal(got, want[: len(got)])
  with pytest.raises(ValueError, match="held-out split"):
    pipeline.heldout_tokens([str(path)], tok, k, batches=10, rows=8, seq_len=8)


def test_the_console_line_gives_the_heldout_loss_its_baseline_steps_per_second_and_eta(tmp_path, monkeypatch):
  clock = iter([100.0, 101.0])  # when each record is written
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
  writer = metrics.MetricWriter(str(tmp_path), 10, tensorboard=False, total_steps=110, heldout_unigram_entropy=4.5)
  step_metrics = {
    "loss": 5.0,
    "task_loss": 5.0,
    "accuracy": 0.1,
    "aux_loss": 0.0,
    "grad_norm": 1.0,
    "learning_rate": 1e-3,
    "expert_counts": np.ones((1, 4)),
    "tokens_dropped": np.zeros(1),
    "tokens_overflowed": np.zeros(1),
    "heldout_loss": 4.75,
  }
  records = [
    metrics.step_record(11, {**step_metrics, "heldout_loss": np.nan}, 0.5, 100),
    metrics.step_record(12, step_metrics, 0.5, 100),
  ]
  for record in records:
    writer.write(record)
  writer.close()
  assert "heldout_loss" not in records[0] and records[1]["heldout_loss"] == 4.75
  assert records[1]["heldout_unigram_entropy"] == 4.5
  # The first step began 0.5 s before it was written: 2 steps in 1.5 s, 98 steps left at that rate.
  assert records[1]["steps_per_s"] == pytest.approx(2 / 1.5)
  assert records[1]["eta_s"] == pytest.approx(98 * 1.5 / 2)
  line = metrics.report_line(records[1], 110)
  assert "held-out 4.7500 (unigram 4.5000)" in line
  assert line.endswith("1.33 steps/s  ETA 1m14s")
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [11, 12]


@pytest.mark.slow  # a 3-step run (about 30 s on 2 cores with the corpus and tokenizer made)
def test_the_heldout_loss_in_the_records_is_the_checkpoints_loss_on_the_heldout_documents(shared, tmp_path):
  from experiments.convergence import heldout_loss

  workdir = tiny_decoder_run(shared)
  records = metrics.read_jsonl(str(workdir / "metrics.jsonl"))
  assert ["heldout_loss" in r for r in records] == [False, True, True]  # every 2nd step and the last
  config = tiny_decoder_config(shared)
  corpus = data.corpus_files("", config.data.cache_dir)[0]
  with open(corpus) as f:
    held = f.readlines()[config.data.heldout_every - 1 :: config.data.heldout_every]
  (tmp_path / "heldout.jsonl").write_text("".join(held))
  want = heldout_loss(config, str(workdir), str(tmp_path / "heldout.jsonl"), config.log.eval_batches)
  assert records[-1]["heldout_loss"] == pytest.approx(want, rel=1e-5)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["final_heldout_loss"] == records[-1]["heldout_loss"]
  console = (workdir / "console").read_text()
  assert f"held-out {records[-1]['heldout_loss']:.4f} (unigram {summary['heldout_unigram_entropy']:.4f})" in console
  assert "ETA" in console and "steps/s" in console
  assert (
    f"the data's unigram entropy {summary['unigram_entropy']:.4f} nats is the baseline a model must beat" in console
  )


def test_heldout_evaluation_needs_a_heldout_split(shared, tmp_path):
  config = tiny_decoder_config(shared)
  config.data.heldout_every = 0
  with pytest.raises(ConfigError, match="log.eval_every"):
    train.train(config, str(tmp_path))


def test_plot_run_draws_the_heldout_loss_and_its_baseline_in_the_loss_panel(tmp_path):
  from experiments import plot_run

  writer = metrics.MetricWriter(str(tmp_path), 0, tensorboard=False, heldout_unigram_entropy=4.5)
  for step in range(1, 5):
    step_metrics = {
      "loss": 6.0 - step,
      "task_loss": 6.0 - step,
      "accuracy": 0.1,
      "aux_loss": 0.0,
      "grad_norm": 1.0,
      "learning_rate": 1e-3,
      "expert_counts": np.ones((1, 4)),
      "tokens_dropped": np.zeros(1),
      "tokens_overflowed": np.zeros(1),
      "heldout_loss": 7.0 - step if step % 2 == 0 else np.nan,
    }
    writer.write(metrics.step_record(step, step_metrics, 0.1, 100))
  writer.close()
  fig = plot_run.draw({"run": plot_run.load_records(str(tmp_path))})
  [ax] = [ax for ax in fig.axes if ax.get_title().startswith("loss")]
  lines = {line.get_label(): line for line in ax.get_lines()}
  np.testing.assert_array_equal(lines["held-out"].get_xdata(), [2, 4])
  np.testing.assert_array_equal(lines["held-out"].get_ydata(), [5.0, 3.0])
  np.testing.assert_array_equal(lines["unigram entropy of the held-out tokens"].get_ydata(), [4.5, 4.5])
