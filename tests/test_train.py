"""Training end to end: convergence for every routing, kill-and-resume, corrupt checkpoints, and a
2-process job that matches the single-process run step for step.

The training runs (`experiments.train` subprocesses) are built once per test session (under locks in the
session's temporary directory; one xdist worker runs the module); a 12-step topk run on the convergence runs' learning-rate schedule, with
every piece of state a step updates besides the parameters (STATEFUL), is the uninterrupted single-process
reference of the kill-and-resume, 2-process and overflow tests.
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

from moejax import checkpoint
from moejax.data.tokenizer import cache_lock
from moejax.moe import replicas
from moejax.moe.config import ROUTINGS
from moejax.moe.routing import ROUTERS
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import metrics, objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ENV, ROOT

sys.path.insert(0, str(ROOT))
from configs import mlm  # noqa: E402

# slow: end-to-end training runs; one xdist worker runs the module, so no worker waits for a run the other is building.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train")]

CONVERGENCE_STEPS = 200  # the topk run; the other routings run the first ROUTING_STEPS of the same schedule
ROUTING_STEPS = 60
# The learning runs' mesh: 2 nodes (the node routings need them) of one device each, twice as fast per step as
# 2 x 4; the distributed layer itself is the layer tests' (the resume and 2-process runs keep 2 x 4).
LEARNING_MESH = (2, 1)
# State a step updates besides the parameters and optimizer: DeepSeek-V3's loss-free balancing bias, and slot
# tables re-planned every 2 steps from a 4-step window of loads (so a resume from step 3, 6 or 9 needs the window
# the checkpoint kept).
STATEFUL = {"bias_update_rate": 0.01, "slots_per_device": 2, "replan_every": 2, "replan_window": 4}
# The first 12 steps of the convergence runs' schedule, with that state, and FSDP (the dense parameters and their
# optimizer states sharded over the 8 devices: saved, restored and run in two processes as they are; FSDP trains
# to the replicated run's losses bit for bit, tests/test_fsdp.py).
SHORT = [
  "--config.steps=12",
  "--config.checkpoint.every_steps=3",
  "--config.log.every_steps=1",
  "--config.model.fsdp=True",
  f"--config.optim.decay_steps={CONVERGENCE_STEPS}",
  *(f"--config.moe.{k}={v}" for k, v in STATEFUL.items()),
]


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


def _trained(shared, name, *overrides, optimised=False):
  """The tiny MLM trained by `experiments.train` with `overrides` in <shared>/<name> (once per session).
  optimised: with XLA's CPU optimisations, which the suite turns off for its many compile-once programs (a
  learning run's step is 2.5x faster with them)."""
  return _once(
    shared,
    name,
    lambda directory: _run(
      shared, _command(shared, directory, *overrides), directory / "log", xla_flags="" if optimised else None
    ),
  )


def _learned(shared, routing, steps):
  """The first `steps` steps of the CONVERGENCE_STEPS schedule with `routing` on LEARNING_MESH."""
  return _trained(
    shared,
    f"learned-{routing}-{steps}",
    f"--config.steps={steps}",
    f"--config.moe.routing={routing}",
    f"--config.optim.decay_steps={CONVERGENCE_STEPS}",
    f"--config.checkpoint.every_steps={steps}",
    f"--config.mesh.nodes={LEARNING_MESH[0]}",
    f"--config.mesh.gpus_per_node={LEARNING_MESH[1]}",
    "--config.log.tensorboard=False",
    optimised=True,
  )


def _reference(shared):
  """The uninterrupted 12-step single-process run of SHORT (its compiled step is in the cache the kill-and-resume
  runs read)."""
  return _trained(shared, "reference", *SHORT)


def _final_states(*directories):
  """The newest checkpoint of the SHORT config in each directory: (step, state as NumPy arrays, host state)."""
  config = mlm.get_config()
  config.moe.update(STATEFUL)
  model_cfg, moe_cfg = config_lib.validate(config)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  abstract_state = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), tok).abstract_state
  found = []
  for directory in directories:
    ckpt = checkpoint.Checkpointer(os.path.join(directory, "checkpoints"), keep=3, use_async=False)
    try:
      step, state, host = ckpt.restore_latest(abstract_state)
    finally:
      ckpt.close()
    found.append((step, jax.tree.map(np.asarray, state), host))
  return found


def _command(shared, workdir, *overrides):
  return [
    sys.executable,
    "-m",
    "experiments.train",
    "--config=configs/mlm.py",
    f"--workdir={workdir}",
    f"--config.data.cache_dir={shared / 'cache'}",
    *overrides,
  ]


def _env(shared):
  return {
    **ENV,
    "JAX_COMPILATION_CACHE_DIR": str(shared / "jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }


def _run(shared, command, log, timeout=300, xla_flags=None):
  env = _env(shared) if xla_flags is None else {**_env(shared), "XLA_FLAGS": xla_flags}
  with open(log, "w") as out:
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
  assert done.returncode == 0, open(log).read()[-5000:]


def _records(directory, steps=None):
  records = metrics.read_jsonl(os.path.join(directory, "metrics.jsonl"))[:steps]
  assert [r["step"] for r in records] == list(range(1, len(records) + 1))
  return records


def _losses(directory, steps=None, key="loss"):
  return np.array([r[key] for r in _records(directory, steps)])


def test_tiny_mlm_learns_beyond_unigram_statistics(shared):
  directory = _learned(shared, "topk", CONVERGENCE_STEPS)
  summary = json.loads((directory / "summary.json").read_text())
  losses = _losses(directory, key="task_loss")
  assert len(losses) == CONVERGENCE_STEPS
  unigram, first, final = summary["unigram_entropy"], losses[0], np.mean(losses[-30:])
  print(f"step-0 loss {first:.3f}, unigram baseline {unigram:.3f}, final {final:.3f}")
  assert first > unigram and final < first - 1.0
  # Uses context, not only token frequencies: no context-free predictor beats the unigram entropy of
  # the tokens fed, and the 30-step mean (about 9k predictions) has a standard error near 0.02.
  assert final < unigram - 0.1, (final, unigram)


@pytest.mark.parametrize("routing", [r for r in ROUTINGS if r != "topk" and not ROUTERS[r].needs_token_ids])
def test_other_routings_learn_as_fast_as_topk(shared, routing):
  """The same model with another router tracks flat top-k over the first ROUTING_STEPS steps (whose loss falls
  by more than 1 nat): 20-step means within 0.05 (they differ by under 0.02 in practice). How the routers
  compare over whole runs is the convergence study's (experiments/convergence.py)."""
  losses = _losses(_learned(shared, routing, ROUTING_STEPS), key="task_loss")
  flat = _losses(_learned(shared, "topk", CONVERGENCE_STEPS), steps=ROUTING_STEPS, key="task_loss")
  curve, flat_curve = losses.reshape(-1, 20).mean(axis=1), flat.reshape(-1, 20).mean(axis=1)
  print(f"{routing} vs topk, means over 20 steps: {np.round(curve, 3)} vs {np.round(flat_curve, 3)}")
  assert len(losses) == ROUTING_STEPS and curve[-1] < losses[0] - 1.0
  assert np.abs(curve - flat_curve).max() < 0.05


def test_killed_run_resumes_bit_identically(shared, tmp_path):
  """SIGKILLed after step 7 and resumed from its newest checkpoint: every step's record (losses, loads, the
  balancing bias' range, re-planned slot tables) and the final state (parameters, optimizer, bias, slot
  tables, RNG) are those of the uninterrupted run, bit for bit; the re-plans reuse the compiled step."""
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

  _run(shared, command, tmp_path / "resumed.log")
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["resumed_from"] in (3, 6, 9)
  assert (tmp_path / "resumed.log").read_text().count("compiled the train step") == 1
  reference = _reference(shared)
  want = _losses(reference)  # uninterrupted
  np.testing.assert_array_equal(killed, want[: len(killed)])
  got_records, want_records = _records(workdir), _records(reference)
  for key in ("loss", "task_loss", "expert_load", "expert_bias_range", "busiest_load"):
    assert [r[key] for r in got_records] == [r[key] for r in want_records], key  # exactly, step for step
  replanned = lambda records: {r["step"]: r["replanned_slot_tables"] for r in records if "replanned_slot_tables" in r}
  assert replanned(got_records) == replanned(want_records) and len(replanned(want_records)) == 6

  (step, state, host), (want_step, want_state, want_host) = _final_states(workdir, reference)
  assert step == want_step == 12 and host == want_host and len(host["replan_window"]) == STATEFUL["replan_window"]
  assert np.abs(state["expert_bias"]).max() > 0
  assert (state["slot_tables"] != replicas.initial_table(8, 8, 2)).any()  # re-planned
  np.testing.assert_array_equal(state["slot_tables"], replanned(want_records)[12])  # the last re-plan's
  jax.tree.map(np.testing.assert_array_equal, state, want_state)


def test_two_processes_match_one(shared, tmp_path):
  workdir = tmp_path / "run"
  launcher = [sys.executable, "-m", "moejax.runtime.launch", "--processes", "2", "--devices-per-process", "4", "--"]
  # The first 6 steps (3 re-plans), saved at the end only: the same losses.
  first_six = [o for o in SHORT if "every_steps" not in o and not o.startswith("--config.steps=")]
  first_six.append("--config.steps=6")
  _run(shared, launcher + _command(shared, workdir, *first_six), tmp_path / "log")
  got, want = _records(workdir), _records(_reference(shared), 6)
  for key in ("loss", "task_loss", "accuracy", "aux_loss", "grad_norm", "expert_bias_range"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=0, atol=1e-5, err_msg=key)
  for key in ("expert_load", "busiest_load", "replanned_slot_tables"):
    assert [r.get(key) for r in got] == [r.get(key) for r in want], key
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 6 and summary["malformed_lines"] == 0


def _flip_middle_byte(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x40]))


def test_corrupt_checkpoint_is_skipped(mesh_2x4, tmp_path, capsys):
  sharded = NamedSharding(mesh_2x4, P(("node", "gpu")))
  replicated = NamedSharding(mesh_2x4, P())
  make = lambda i: {
    "params": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) + i, sharded)},
    "step": jax.device_put(jnp.int32(i), replicated),
  }
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), make(0))
  directory = tmp_path / "checkpoints"
  ckpt = checkpoint.Checkpointer(str(directory), keep=5)
  for step in (1, 2, 3, 4, 5):
    ckpt.save(step, make(step), [[step]])
  ckpt.close()
  os.makedirs(directory / "6.orbax-checkpoint-tmp-123")  # a save cut short by a kill: never listed
  shutil.rmtree(directory / "5" / "meta")  # partial
  for path in (directory / "4" / "state").rglob("*"):  # damaged array data
    if path.is_file() and "d" in path.relative_to(directory / "4" / "state").parts[:-1]:
      _flip_middle_byte(path)
  meta = json.loads((directory / "3" / "meta" / "metadata").read_text())
  meta["fingerprint"] += 1  # arrays that read back but are not what was saved
  (directory / "3" / "meta" / "metadata").write_text(json.dumps(meta))

  ckpt = checkpoint.Checkpointer(str(directory), keep=5)
  step, state, data_state = ckpt.restore_latest(abstract)
  out = capsys.readouterr().out
  assert step == 2 and data_state == [[2]]
  for bad in (5, 4, 3):
    assert f"checkpoint step {bad} in {directory} is corrupt or incomplete" in out
  assert "fingerprint" in out.splitlines()[-1]
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(make(2)["params"]["w"]))
  ckpt.save(3, make(3), [[3]])  # the skipped steps can be written again
  ckpt.close()
  other = {"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=sharded)}, "step": abstract["step"]}
  with pytest.raises(ConfigError, match="another shape"):
    checkpoint.Checkpointer(str(directory), keep=5).restore_latest(other)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("model.kind", "t5", "model.kind"),
    ("moe.top_k", 0, "moe.top_k"),
    ("batch_size", 12, "batch_size"),
    ("data.shards", 3, "data.shards"),
    ("optim.decay", "step", "optim.decay"),
    ("seq_len", 256, "seq_len"),
    ("data.train_files", "/nonexistent/c4-*.json.gz", "data.train_files"),
    ("moe.num_experts", 12, "num_experts"),
    ("model.grad_sync", "lina", "model.grad_sync"),
  ],
)
def test_bad_configs_are_rejected_before_compiling(field, value, match):
  config = mlm.get_config()
  section, _, name = field.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(config)
  config = mlm.get_config()
  config.model.unknown = 1
  with pytest.raises(ConfigError, match="model.unknown"):
    config_lib.validate(config)


def test_overflowing_steps_are_repeated_or_counted(shared, tmp_path, capsys):
  """Receive buffers of half the local rows overflow: 'retry' repeats each such step with the factor doubled
  and trains exactly like worst-case buffers; 'drop' keeps the step and records the overflowed share."""
  steps = 4
  reference = _losses(_reference(shared), steps)
  results = {}
  for policy in ("retry", "drop"):
    config = mlm.get_config()
    config.update(steps=steps, on_overflow=policy)
    config.moe.update(STATEFUL, buffer_factor=0.5)
    config.optim.decay_steps = CONVERGENCE_STEPS
    config.data.cache_dir = str(shared / "cache")
    config.checkpoint.every_steps = steps
    config.log.tensorboard = False
    workdir = tmp_path / policy
    results[policy] = train.train(config, str(workdir)), _records(workdir)
  summary, records = results["retry"]
  assert summary["overflow_retries"] >= 1 and summary["buffer_factor"] > 0.5
  assert "overflowed the receive buffers at buffer_factor 0.5; repeating the step with 1" in capsys.readouterr().out
  assert all(rate == 0 for r in records for rate in r["overflow_rate"])
  np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=1e-5)
  summary, records = results["drop"]
  assert summary["overflow_retries"] == 0 and summary["buffer_factor"] == 0.5
  assert all(0 < rate < 1 for r in records for rate in r["overflow_rate"])
