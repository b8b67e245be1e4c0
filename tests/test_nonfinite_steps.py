"""Steps that must not change the model (issue 61, `moejax.train.guard`): a batch that makes the loss NaN leaves the
parameters, the optimizer state and the balancing biases bit for bit as the step before left them, is reported on
its record and console line, and train.max_nonfinite_steps of them in a row stop the run with one line naming the
last checkpoint, which loads; with train.loss_spike_factor a step whose loss exceeds k x the recent median is
skipped too."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax import checkpoint
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import guard, inputs, metrics, objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env
from tests.test_heldout import tiny_decoder_config

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=200, num_ids=202)


def _config(shared, **train_section):
  config = tiny_decoder_config(shared)
  config.log.eval_every = 0
  config.train.update(train_section)
  return config


def _poison(config) -> int:
  """A token id past the model's vocabulary: its embedding is NaN (jnp.take fills out-of-range rows), and so the loss
  of a batch that holds it."""
  return config.model.vocab_size


def _bits(tree) -> list:
  """Each leaf's dtype, shape and bytes: equal lists are equal trees bit for bit (NaN and -0.0 included)."""
  leaves = jax.tree.leaves(jax.device_get(tree))
  return [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes()) for x in leaves]


def _kept_bits(state) -> list:
  return _bits({k: state[k] for k in guard.KEPT if k in state})


@pytest.fixture(scope="module")
def stepper(shared):
  """(trainer with a loss-spike window, its fresh state and rest, a batch [1, 8, 32] of ordinary tokens, one of
  poison); the step is not donated, so every state stays readable."""
  config = _config(shared, loss_spike_factor=3.0)
  _, model_cfg, moe_cfg = config_lib.checked(config)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), TOK, donate=False)
  state, rest = trainer.init()
  shape = (config.micro_batches, config.batch_size // config.micro_batches, config.seq_len)
  good = np.random.default_rng(0).integers(TOK.first_ordinary, TOK.num_ids, shape, dtype=np.int32)
  put = lambda tokens: jax.device_put(tokens, trainer.batch_sharding)
  return trainer, state, rest, put(good), put(np.full(shape, _poison(config), np.int32))


def test_a_nan_batch_leaves_the_state_of_the_step_before(stepper):
  trainer, state, rest, good, poison = stepper
  after_good, m = trainer.step(state, rest, good)
  assert not bool(m["skipped"]) and np.isfinite(float(m["loss"]))
  assert _kept_bits(after_good) != _kept_bits(state)  # an applied step changes them
  after_nan, m = trainer.step(after_good, rest, poison)
  assert bool(m["skipped"]) and bool(m["nonfinite"]) and np.isnan(float(m["loss"]))
  assert _kept_bits(after_nan) == _kept_bits(after_good)
  assert _bits(after_nan["loss_window"]) == _bits(after_good["loss_window"])  # a skipped loss is not a recent loss
  assert int(after_nan["step"]) == int(after_good["step"]) + 1  # the run's step count (and data) moves on


def test_a_loss_spike_over_k_times_the_recent_median_is_skipped(stepper):
  trainer, state, rest, good, _ = stepper
  first, m = trainer.step(state, rest, good)
  loss = float(m["loss"])
  window = jax.device_get(first["loss_window"])
  assert np.isnan(window[:-1]).all() and window[-1] == np.float32(loss)
  # The same batch again, against a window of recent losses a tenth of it: more than 3x the median, skipped.
  low = {**first, "loss_window": jax.device_put(np.full(guard.WINDOW, loss / 10, np.float32), trainer.replicated)}
  after, m = trainer.step(low, rest, good)
  assert bool(m["skipped"]) and not bool(m["nonfinite"])
  assert _kept_bits(after) == _kept_bits(first)
  # Against recent losses ten times it: applied, and its loss enters the window.
  high = {**first, "loss_window": jax.device_put(np.full(guard.WINDOW, loss * 10, np.float32), trainer.replicated)}
  after, m = trainer.step(high, rest, good)
  assert not bool(m["skipped"]) and _kept_bits(after) != _kept_bits(first)
  np.testing.assert_array_equal(
    jax.device_get(after["loss_window"]), [np.float32(loss * 10)] * (guard.WINDOW - 1) + [np.float32(m["loss"])]
  )


class _Poisoned:
  """The training batches with every batch from the `first`-th on replaced by `poison` tokens."""

  def __init__(self, batches, first: int, poison: int):
    self.batches, self.first, self.poison, self.served = batches, first, poison, 0

  def __next__(self):
    local = next(self.batches)
    self.served += 1
    return np.full_like(local, self.poison) if self.served >= self.first else local

  def __getattr__(self, name):
    return getattr(self.batches, name)


def _restored(config, directory):
  """(step, state as host arrays) of the newest intact checkpoint in `directory`."""
  _, model_cfg, moe_cfg = config_lib.checked(config)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), TOK)
  ckpt = checkpoint.Checkpointer(str(directory), keep=10, use_async=False)
  step, state, _ = ckpt.restore_latest(trainer.abstract_state)
  ckpt.close()
  return step, state


@pytest.mark.slow
def test_nan_steps_are_skipped_counted_and_stop_the_run_at_the_limit(shared, tmp_path, monkeypatch, capsys):
  config = _config(shared, max_nonfinite_steps=2)
  config.steps = 6
  config.checkpoint.update(every_steps=1, keep=10)
  real = inputs.batches
  monkeypatch.setattr(inputs, "batches", lambda *a: _Poisoned(real(*a), 3, _poison(config)))
  with pytest.raises(guard.TrainingStopped) as stopped:
    train.train(config, str(tmp_path))
  message = str(stopped.value)
  assert "\n" not in message and message.startswith("step 4: 2 steps in a row skipped (non-finite loss")
  assert f"the last checkpoint, step 3 in {tmp_path / 'checkpoints'}, holds the parameters of step 2" in message
  assert "train.max_nonfinite_steps" in message

  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [
    (1, 0, 0),
    (2, 0, 0),
    (3, 1, 1),
    (4, 1, 2),
  ]
  assert np.isnan(records[2]["loss"]) and records[2]["skip_reason"] == "nonfinite"
  console = capsys.readouterr().out
  assert "step 3/6  skipped: non-finite loss or gradient norm, 1 so far  loss nan" in console
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "3"]  # nothing saved after the stop

  # The last checkpoint loads, and holds step 2's parameters, optimizer state and biases bit for bit.
  step, last = _restored(config, tmp_path / "checkpoints")
  assert step == 3
  shutil.rmtree(tmp_path / "checkpoints" / "3")
  step, before = _restored(config, tmp_path / "checkpoints")
  assert step == 2 and _kept_bits(last) == _kept_bits(before)


@pytest.mark.slow  # a subprocess that compiles its own step (about 40 s on 2 cores)
def test_the_trainer_stops_a_diverged_run_with_one_line_and_status_1(shared, tmp_path):
  """A learning rate of 1e30 makes every loss after the first NaN: experiments.train stops after 2 of them."""
  flags = [
    "--config=configs/mlm.py",
    f"--workdir={tmp_path}",
    "--config.steps=6",
    "--config.batch_size=8",
    "--config.micro_batches=1",
    "--config.seq_len=32",
    f"--config.data.cache_dir={shared / 'cache'}",
    "--config.data.tokenizer_train_chars=100000",
    "--config.log.eval_every=0",
    "--config.log.tensorboard=False",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.use_async=False",
    "--config.optim.learning_rate=1e30",
    "--config.train.max_nonfinite_steps=2",
  ]
  done = subprocess.run(
    [sys.executable, "-m", "experiments.train", *flags], cwd=ROOT, env=cpu_env(), capture_output=True, text=True
  )
  last = done.stderr.strip().splitlines()[-1]
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert last.startswith("error: step ") and "2 steps in a row skipped" in last and "the last checkpoint" in last
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["skipped"] for r in records][-2:] == [1, 1]


@pytest.mark.parametrize(
  "field,value", [("max_nonfinite_steps", -1), ("loss_spike_factor", 0.5), ("loss_spike_factor", -3.0)]
)
def test_the_train_sections_fields_are_checked(shared, field, value):
  config = _config(shared, **{field: value})
  with pytest.raises(ConfigError, match=f"train.{field}"):
    config_lib.checked(config)
