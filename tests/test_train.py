"""Training end to end: convergence for every routing, kill-and-resume, corrupt checkpoints, and a
2-process job that matches the single-process run step for step.

Runs that several tests need (the tokenizer, the single-process reference) are built once per test
session, shared by the xdist workers through a lock in the session's temporary directory.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import checkpoint, metrics, train
from moejax.config import ROUTINGS, ConfigError
from moejax.tokenizer import cache_lock
from tests.test_launch import ENV, ROOT

sys.path.insert(0, str(ROOT))
from configs import mlm  # noqa: E402

CONVERGENCE_STEPS = 200
# The first 12 steps of the long schedule, with dropout so that resuming must restore the RNG.
SHORT = ["--config.steps=12", "--config.checkpoint.every_steps=3", "--config.log.every_steps=1",
         f"--config.optim.decay_steps={CONVERGENCE_STEPS}", "--config.model.dropout=0.1"]


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
  """A directory shared by all workers of this test session, with the data cache inside."""
  base = tmp_path_factory.getbasetemp()
  path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "train-shared"
  (path / "cache").mkdir(parents=True, exist_ok=True)
  return path


def _once(shared, name, build):
  """Runs `build(directory)` once per session (under a lock); returns the directory."""
  directory = shared / name
  with cache_lock(str(shared / "locks" / name)):
    if not (directory / "done").exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      build(directory)
      (directory / "done").touch()
  return directory


def _command(shared, workdir, *overrides):
  return [sys.executable, "-m", "experiments.train", "--config=configs/mlm.py", f"--workdir={workdir}",
          f"--config.data.cache_dir={shared / 'cache'}", *overrides]


def _env(shared):
  return {**ENV, "JAX_COMPILATION_CACHE_DIR": str(shared / "jax-cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _run(shared, command, log, timeout=300):
  with open(log, "w") as out:
    done = subprocess.run(command, cwd=ROOT, env=_env(shared), stdout=out, stderr=subprocess.STDOUT,
                          timeout=timeout)
  assert done.returncode == 0, open(log).read()[-5000:]


def _losses(workdir):
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, len(records) + 1))
  return np.array([r["loss"] for r in records])


@pytest.fixture(scope="session")
def reference(shared):
  """The first 12 steps of the tiny MLM, one process with 8 devices."""
  return _once(shared, "reference", lambda d: _run(shared, _command(shared, d / "run", *SHORT), d / "log"))


def _converge(shared, routing):
  def build(directory):
    config = mlm.get_config()
    config.steps = CONVERGENCE_STEPS
    config.moe.routing = routing
    config.data.cache_dir = str(shared / "cache")
    config.checkpoint.every_steps = CONVERGENCE_STEPS
    config.log.tensorboard = False
    summary = train.train(config, str(directory))
    (directory / "result.json").write_text(json.dumps(summary))

  return _once(shared, f"converge-{routing}", build)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_tiny_mlm_learns_beyond_unigram_statistics(shared, routing):
  directory = _converge(shared, routing)
  summary = json.loads((directory / "result.json").read_text())
  losses = [r["task_loss"] for r in metrics.read_jsonl(str(directory / "metrics.jsonl"))]
  assert len(losses) == CONVERGENCE_STEPS
  unigram, first, final = summary["unigram_entropy"], losses[0], np.mean(losses[-30:])
  print(f"{routing}: step-0 loss {first:.3f}, unigram baseline {unigram:.3f}, final {final:.3f}")
  assert first > unigram and final < first - 1.0
  assert final < unigram - 0.15, (final, unigram)  # uses context, not only token frequencies


@pytest.mark.skipif(len(ROUTINGS) < 2, reason="one routing only")
def test_routings_learn_alike(shared):
  final = {}
  for routing in ROUTINGS:
    losses = [r["task_loss"] for r in metrics.read_jsonl(str(_converge(shared, routing) / "metrics.jsonl"))]
    final[routing] = [np.mean(losses[i:i + 50]) for i in range(0, len(losses), 50)]
  for routing, curve in final.items():
    assert np.abs(np.subtract(curve, final["topk"])).max() < 0.15, (routing, curve, final["topk"])


def test_killed_run_resumes_with_identical_losses(shared, reference, tmp_path):
  want = _losses(reference / "run")
  workdir = tmp_path / "run"
  command = _command(shared, workdir, *SHORT)
  with open(tmp_path / "killed.log", "w") as out:
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(shared), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while len(metrics.read_jsonl(str(workdir / "metrics.jsonl"))) < 7:  # checkpoints 3 and 6 are underway
      assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "killed.log").read()[-5000:]
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  killed = _losses(workdir)
  assert 7 <= len(killed) < 12
  np.testing.assert_array_equal(killed, want[:len(killed)])

  _run(shared, command, tmp_path / "resumed.log")
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["resumed_from"] in (3, 6, 9)
  np.testing.assert_array_equal(_losses(workdir), want)  # exactly, step for step


def test_two_processes_match_one(shared, reference, tmp_path):
  workdir = tmp_path / "run"
  launcher = [sys.executable, "-m", "moejax.launch", "--processes", "2", "--devices-per-process", "4", "--"]
  _run(shared, launcher + _command(shared, workdir, *SHORT), tmp_path / "log")
  np.testing.assert_allclose(_losses(workdir), _losses(reference / "run"), rtol=0, atol=1e-5)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 12 and summary["malformed_lines"] == 0


def test_corrupt_checkpoint_is_skipped(mesh_2x4, tmp_path, capsys):
  sharded = NamedSharding(mesh_2x4, P(("node", "gpu")))
  replicated = NamedSharding(mesh_2x4, P())
  make = lambda i: {"params": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) + i, sharded)},
                    "step": jax.device_put(jnp.int32(i), replicated)}
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), make(0))
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpoint.Checkpointer(directory, keep=5)
  for step in (1, 2, 3, 4):
    ckpt.save(step, make(step), [[step]])
  ckpt.close()
  os.makedirs(os.path.join(directory, "5.orbax-checkpoint-tmp-123"))  # a save cut short by a kill
  shutil.rmtree(os.path.join(directory, "4", "meta"))  # partial
  for root, _, files in os.walk(os.path.join(directory, "3", "state")):  # damaged array data
    for name in files:
      if os.sep + "d" + os.sep in os.path.join(root, name) + os.sep and os.path.getsize(os.path.join(root, name)) > 8:
        with open(os.path.join(root, name), "r+b") as f:
          f.seek(os.path.getsize(os.path.join(root, name)) // 2)
          byte = f.read(1)
          f.seek(-1, os.SEEK_CUR)
          f.write(bytes([byte[0] ^ 0x40]))

  ckpt = checkpoint.Checkpointer(directory, keep=5)
  step, state, data_state = ckpt.restore_latest(abstract)
  out = capsys.readouterr().out
  assert step == 2 and data_state == [[2]]
  assert "checkpoint step 4" in out and "checkpoint step 3" in out and "skipping it" in out
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(make(2)["params"]["w"]))
  ckpt.save(3, make(3), [[3]])  # the skipped steps can be written again
  ckpt.close()
  with pytest.raises(ConfigError, match="another shape"):
    other = {"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=sharded)}, "step": abstract["step"]}
    checkpoint.Checkpointer(directory, keep=5).restore_latest(other)


@pytest.mark.parametrize("field,value,match", [
    ("model.kind", "t5", "model.kind"), ("moe.top_k", 0, "moe.top_k"), ("batch_size", 12, "batch_size"),
    ("data.shards", 3, "data.shards"), ("optim.decay", "step", "optim.decay"), ("seq_len", 256, "seq_len"),
    ("data.train_files", "/nonexistent/c4-*.json.gz", "data.train_files"), ("moe.num_experts", 12, "num_experts")])
def test_bad_configs_are_rejected_before_compiling(field, value, match):
  config = mlm.get_config()
  section, _, name = field.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(ConfigError, match=match):
    train.validate(config)
  config = mlm.get_config()
  config.model.unknown = 1
  with pytest.raises(ConfigError, match="model.unknown"):
    train.validate(config)
