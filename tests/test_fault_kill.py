"""Nothing a user does loses their work: the trainer, an export and a sweep SIGKILLed at random moments and run again
with the same command. Whatever a killed program leaves is whole (no half-written JSON, no torn line but a jsonl
file's last, no checkpoint listed that does not read back as the uninterrupted run's), and the run that completes
writes exactly what an uninterrupted run writes (the trainer's parameters and records bit for bit, the export's files
byte for byte, the sweep's rows).

Each program runs under KILLER, which counts its file-system writes under its workdir (Python's audit hooks: opens
for writing, renames, removals, directories made) and SIGKILLs it at a chosen one, so a kill can land inside a
checkpoint's or a file's write; the others are killed a random time after they start. The first kill of each program
is aimed at the write that was unsafe before (`TARGETED`); the rest are drawn from MOEJAX_FAULT_SEED (printed).

MOEJAX_FAULT_KILLS kills per program (default 3): `MOEJAX_FAULT_KILLS=20 python -m pytest -p no:cacheprovider
tests/test_fault_kill.py` is 20 runs in a row of each.
"""

import csv
import fnmatch
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import export
from moejax import checkpoint, workdir_guard
from moejax.study.store import POINTS_FILE, SIMULATIONS_FILE
from tests.helpers import ROOT
from tests.test_heldout import tiny_decoder_run
from tests.test_train import _command, _env, _once, _run

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fault_kill")]

KILLS = int(os.environ.get("MOEJAX_FAULT_KILLS", "3"))
SEED = int(os.environ.get("MOEJAX_FAULT_SEED", random.randrange(2**31)))

# python -c KILLER MODULE ARGS...: runs `python -m MODULE ARGS...`; FAULT_TARGET: the directory whose writes count;
# FAULT_KILL_AT: 'N' (SIGKILL at the N-th write there), 'N:NAME' (the N-th write of a file whose name starts with
# NAME) or '0' (count them: 'fault-writes N' on stderr at exit). Audit events come before what they announce: a rename
# or a removal is killed before it happens, an open for writing once it has happened, at the thread's next call of a
# file's write, flush or close (`sys.setprofile`), so the file is there, emptied or new, with nothing written yet.
KILLER = r"""
import atexit, os, runpy, signal, sys
target = os.path.abspath(os.environ.pop("FAULT_TARGET")) + os.sep
at, _, name = os.environ.pop("FAULT_KILL_AT").partition(":")
at, count = int(at), [0]
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate")

def kill():
  os.kill(os.getpid(), signal.SIGKILL)

def at_first_write(frame, event, arg):
  if event == "c_call" and getattr(arg, "__name__", "") in ("write", "writelines", "flush", "close", "truncate"):
    kill()

def hook(event, args):
  if event == "open":
    path, mode, flags = args
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(isinstance(flags, int) and flags & WRITE)
  elif event in CHANGES:
    path, writes = args[0], True
  else:
    return
  if not writes or not isinstance(path, (str, bytes, os.PathLike)):
    return
  path = os.path.abspath(os.fsdecode(path))
  if path.startswith(target) and os.path.basename(path).startswith(name):
    count[0] += 1
    if count[0] == at and event == "open":  # once the file is made or emptied, before anything is in it
      sys.setprofile(at_first_write)
    elif count[0] == at:  # before the change
      kill()

sys.addaudithook(hook)
if at == 0:
  atexit.register(lambda: print(f"fault-writes {count[0]}", file=sys.stderr, flush=True))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _launch(command, env, log, target, kill_at=None, delay=None):
  """Runs `command` (python -m MODULE ...) under KILLER with writes under `target` counted; SIGKILLed at its
  `kill_at` write ('N' or 'N:NAME') or `delay` seconds after it starts. Returns whether it was killed (else it must
  have succeeded)."""
  assert command[:2] == [sys.executable, "-m"]
  env = {**env, "FAULT_TARGET": str(target), "FAULT_KILL_AT": str(kill_at or 0)}
  with open(log, "w") as out:
    proc = subprocess.Popen(
      [sys.executable, "-c", KILLER, *command[2:]], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
    )
    try:
      proc.wait(timeout=delay if delay is not None else 300)
    except subprocess.TimeoutExpired:
      if delay is None:
        raise
      proc.send_signal(signal.SIGKILL)
      proc.wait()
  if proc.returncode == -signal.SIGKILL:
    return True
  assert proc.returncode == 0, open(log).read()[-5000:]
  return False


def _reference(shared, name, command, target):
  """The uninterrupted run of `command` into `target` (once per session): its writes counted into
  <target>/../<name>.json with its wall time."""

  def build(directory):
    shutil.rmtree(target, ignore_errors=True)  # what a build cut short left
    start = time.perf_counter()
    _launch(command, _env(shared), directory / "log", target)
    writes = int(open(directory / "log").read().rsplit("fault-writes ", 1)[1].split()[0])
    (directory / "writes.json").write_text(json.dumps({"writes": writes, "wall_s": time.perf_counter() - start}))

  directory = _once(shared, name, build)
  return json.loads((directory / "writes.json").read_text())


def _kills(name, stats):
  """The kills of program `name` after its targeted ones: (kill_at, delay) each, half at a write drawn uniformly from
  the uninterrupted run's, half at a time drawn uniformly over its wall time."""
  rng = random.Random(f"{SEED}-{name}")
  print(f"{name}: MOEJAX_FAULT_SEED={SEED}")
  while True:
    yield str(rng.randint(1, stats["writes"])), None
    yield None, rng.uniform(0.5, stats["wall_s"])


def _sequence(name, stats, targeted, launch, after_kill, completed, start_fresh):
  """KILLS kills: the `targeted` ((kill_at, before) pairs: `before(workdir)` first, e.g. a torn line) and then random
  ones (`_kills`). `launch(workdir, kill_at, delay)` -> killed; `after_kill(workdir)` checks what a kill left;
  `completed(workdir, run_again)` runs the same command once more without kills (unless the last launch finished)
  and checks the finished outputs; a run that finishes before its kill counts no kill and the next ones go to
  `start_fresh()`'s workdir."""
  workdir, kills, dirty = start_fresh(), 0, False
  random_kills = _kills(name, stats)
  plan = [(at, None, before) for at, before in targeted]
  while kills < KILLS:
    at, delay, before = plan.pop(0) if plan else (*next(random_kills), None)
    if before is not None:
      before(workdir)
    if launch(workdir, at, delay):
      kills += 1
      print(f"{name}: kill {kills} in {workdir.name}: " + (f"at write {at}" if at else f"after {delay:.1f} s"))
      dirty = True
      after_kill(workdir)
    else:
      completed(workdir, run_again=False)
      workdir, dirty = start_fresh(), False
  if dirty:
    completed(workdir, run_again=True)
  print(f"{name}: {kills} kills")


def _jsonl_lines(path, complete: bool):
  """The records of a jsonl file: every line whole but, unless `complete`, a last one without its newline (a write
  cut by the kill)."""
  if not os.path.exists(path):
    return []
  text = open(path).read()
  lines = text.split("\n")
  assert complete is False or lines[-1] == "", f"{path}: a last line without its newline: {lines[-1][:80]!r}"
  return [json.loads(line) for line in lines[:-1]]


def _whole_json(path):
  """The JSON in `path` (None where there is none): never a cut file."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


# --- training -----------------------------------------------------------------------------------------------------

STEPS = 8
TRAIN = [
  f"--config.steps={STEPS}",
  "--config.checkpoint.every_steps=1",  # a checkpoint after every step: most kills land in or beside a write
  "--config.log.every_steps=1",
  "--config.log.tensorboard=False",
  "--config.mesh.nodes=1",
  "--config.mesh.gpus_per_node=2",
  "--config.moe.num_nodes=1",
  "--config.moe.bias_update_rate=0.01",  # a state a step updates besides the parameters
  "--config.batch_size=4",
  "--config.micro_batches=1",
  "--config.seq_len=32",
  "--config.data.shards=2",
]
RECORD_KEYS = ("step", "loss", "task_loss", "accuracy", "aux_loss", "grad_norm", "learning_rate", "expert_load")


def _checkpoints(directory):
  """{step: (state as NumPy arrays, host state) or None where it does not read back} of every step orbax lists in
  `directory` (read-only)."""
  if not os.path.isdir(directory):
    return {}
  handlers = {
    "state": ocp.PyTreeCheckpointHandler(type_handler_registry=checkpoint._type_handlers()),
    "meta": ocp.JsonCheckpointHandler(),
  }
  manager = ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=handlers
  )
  found = {}
  for step in manager.all_steps():
    try:
      tree = manager.item_metadata(step)["state"].tree
      as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.PyTreeRestore(tree, as_numpy), meta=ocp.args.JsonRestore()),
      )
      found[step] = restored["state"], {k: v for k, v in restored["meta"].items() if k != "describe"}
    except Exception:  # noqa: BLE001 - orbax raises many kinds of errors for unreadable files
      found[step] = None
  manager.close()
  return found


def _same_checkpoint(got, want, step):
  (state, meta), (want_state, want_meta) = got, want
  assert meta == want_meta, step
  assert jax.tree.structure(state) == jax.tree.structure(want_state), step
  jax.tree.map(np.testing.assert_array_equal, state, want_state)


def test_training_killed_at_random_moments_resumes_bit_identically(shared, tmp_path):
  reference = shared / "fault-train-run"
  stats = _reference(
    shared, "fault-train", _command(shared, reference, *TRAIN, "--config.checkpoint.keep=100"), reference
  )
  want_records = _jsonl_lines(reference / "metrics.jsonl", complete=True)
  want_checkpoints = _checkpoints(str(reference / "checkpoints"))
  assert sorted(want_checkpoints) == list(range(1, STEPS + 1))
  want_config = json.loads((reference / "config.json").read_text())
  fresh = iter(range(10**6))
  expected_resume = {}

  def launch(workdir, at, delay):
    log = tmp_path / f"{workdir.name}-{time.monotonic_ns()}.log"
    killed = _launch(_command(shared, workdir, *TRAIN), _env(shared), log, workdir, at, delay)
    resumed = [line for line in open(log) if line.startswith("resuming after step")]
    want = [f"resuming after step {expected_resume[workdir]}\n"] if expected_resume.get(workdir) else []
    assert resumed == want or (killed and not resumed), (
      resumed,
      want,
    )  # the newest intact checkpoint, if it got so far
    assert "corrupt or incomplete" not in open(log).read()
    return killed

  def after_kill(workdir):
    for name in ("config.json", "summary.json"):
      _whole_json(workdir / name)
    records = _jsonl_lines(workdir / "metrics.jsonl", complete=False)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for got, want in zip(records, want_records):
      assert {k: got[k] for k in RECORD_KEYS} == {k: want[k] for k in RECORD_KEYS}
    found = _checkpoints(str(workdir / "checkpoints"))
    intact = [step for step, saved in found.items() if saved is not None]
    for step in intact:
      _same_checkpoint(found[step], want_checkpoints[step], step)
    # Only a step being deleted (an old one, past checkpoint.keep) may be unreadable: resuming never reaches it.
    assert all(step < max(intact) for step, saved in found.items() if saved is None), sorted(found)
    assert len(records) >= max(intact, default=0)  # every step checkpointed has its record
    expected_resume[workdir] = max(intact, default=0)

  def completed(workdir, run_again):
    if run_again:
      _run(shared, _command(shared, workdir, *TRAIN), tmp_path / f"{workdir.name}-completed.log")
    records = _jsonl_lines(workdir / "metrics.jsonl", complete=True)
    assert [{k: r[k] for k in RECORD_KEYS} for r in records] == [{k: r[k] for k in RECORD_KEYS} for r in want_records]
    summary = _whole_json(workdir / "summary.json")
    assert (
      summary["steps"] == STEPS
      and summary["final_task_loss"] == json.loads((reference / "summary.json").read_text())["final_task_loss"]
    )
    config = _whole_json(workdir / "config.json")
    same = lambda c: {k: v for k, v in c.items() if k not in ("versions", "history", "checkpoint")}
    assert same(config) == same(want_config)
    found = _checkpoints(str(workdir / "checkpoints"))
    _same_checkpoint(found[STEPS], want_checkpoints[STEPS], STEPS)  # the final state, bit for bit

  def start_fresh():
    return tmp_path / f"run{next(fresh)}"

  # summary.json was written in place: killed as it opened it, a finished run left it empty.
  _sequence("train", stats, [("1:summary.json", None)], launch, after_kill, completed, start_fresh)


# --- export -------------------------------------------------------------------------------------------------------


def _export_command(run, out):
  return [sys.executable, "-m", "experiments.export", f"--config.run={run}", f"--workdir={out}"]


def _files(directory):
  """{relative path: bytes} of every file under `directory`."""
  return {
    os.path.relpath(os.path.join(root, name), directory): open(os.path.join(root, name), "rb").read()
    for root, _, names in os.walk(directory)
    for name in names
  }


def _looks_complete(directory):
  """What `moejax.workdir_guard` takes for an export: config.json beside safetensors."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return "config.json" in names and any(name.endswith(".safetensors") for name in names)


def test_export_killed_at_random_moments_writes_the_same_files(shared, tmp_path):
  run = tiny_decoder_run(shared)
  reference = shared / "fault-export-out"
  stats = _reference(shared, "fault-export", _export_command(run, reference), reference)
  want = _files(reference)
  assert sorted(want) == ["config.json", "model.safetensors", workdir_guard.MARKER]
  fresh = iter(range(10**6))

  def launch(out, at, delay):
    return _launch(_export_command(run, out), _env(shared), tmp_path / f"{out.name}.log", out, at, delay)

  def after_kill(out):
    files = _files(out)
    # Besides the export's files: those being written, and a marker's temporary (a kill as the export claimed out).
    extra = [k for k in files if k not in want]
    assert all(
      k.startswith(export.PARTIAL + os.sep) or fnmatch.fnmatch(k, f"{workdir_guard.MARKER}.*.tmp") for k in extra
    )
    if _looks_complete(out):  # killed after its last file was in place (or refreshing a finished export)
      assert {k: files.get(k) for k in want} == want

  def completed(out, run_again):
    if run_again:
      _run(shared, _export_command(run, out), tmp_path / f"{out.name}-completed.log")
    assert _files(out) == want

  def start_fresh():
    return tmp_path / f"hf{next(fresh)}"

  # config.json was written in place beside the weights: killed as it opened it, the export looked complete.
  _sequence("export", stats, [("1:config.json", None)], launch, after_kill, completed, start_fresh)


# --- a scaling sweep ----------------------------------------------------------------------------------------------

SWEEP = [
  "--config.nodes=1,2",
  "--config.gpus_per_node=2",
  "--config.global_batch=16",
  "--config.schemes=switch,smile",
  *(
    f"--config.models.small.{k}={v}"
    for k, v in dict(d_model=32, d_ff=64, layers=2, moe_layers=1, seq_len=8, micro_batch=4, vocab=100).items()
  ),
  *(f"--config.sim.{k}={v}" for k, v in dict(tokens_per_gpu=8, batches=2, d_model=16, d_ff=32).items()),
]
RESULTS = ("results.csv", "results.json")
PLOTS = ("throughput.png", "efficiency.png", "breakdown.png")


def _sweep_command(workdir):
  return [sys.executable, "-m", "experiments.scaling", f"--workdir={workdir}", *SWEEP]


TIMINGS = ("seconds",)  # a small run's wall time: the one field of the records a rerun does not repeat


def _timeless(record):
  return {k: v for k, v in record.items() if k not in TIMINGS}


def _by_key(records):
  keys = [r["key"] for r in records]
  assert len(set(keys)) == len(keys), "a record stored twice"
  return dict(zip(keys, records))


def _tear_last_record(workdir):
  """A points.jsonl whose last record a kill cut in the middle of its write."""
  path = workdir / POINTS_FILE
  text = path.read_text()
  assert text.count("\n") >= 2
  path.write_text(text[:-20])


def test_sweep_killed_at_random_moments_keeps_every_point_once(shared, tmp_path):
  reference = shared / "fault-sweep-out"
  stats = _reference(shared, "fault-sweep", _sweep_command(reference), reference)
  want = {name: _by_key(_jsonl_lines(reference / name, complete=True)) for name in (POINTS_FILE, SIMULATIONS_FILE)}
  assert len(want[POINTS_FILE]) == 8 and all(r["label"] == "modelled" for r in want[POINTS_FILE].values())
  want_results = {name: (reference / name).read_bytes() for name in RESULTS}
  fresh = iter(range(10**6))
  kept = {}

  def launch(workdir, at, delay):
    log = tmp_path / f"{workdir.name}-{time.monotonic_ns()}.log"
    return _launch(_sweep_command(workdir), _env(shared), log, workdir, at, delay)

  def stored(workdir, complete):
    got = {name: _by_key(_jsonl_lines(workdir / name, complete)) for name in (POINTS_FILE, SIMULATIONS_FILE)}
    for name, records in got.items():
      for key, record in records.items():
        assert _timeless(record) == _timeless(want[name][key]), (name, key)
    return got

  def after_kill(workdir):
    got = stored(workdir, complete=False)
    for name, keys in kept.get(workdir, {}).items():  # nothing stored before is lost
      assert keys <= set(got[name]), (name, sorted(keys - set(got[name])))
    kept[workdir] = {name: set(records) for name, records in got.items()}
    results = {name: (workdir / name).read_bytes() for name in RESULTS if (workdir / name).exists()}
    assert results == {name: want_results[name] for name in results}  # written only once every point is
    for name in PLOTS:
      if (workdir / name).exists():
        assert (workdir / name).read_bytes().endswith(b"IEND\xaeB`\x82"), name  # a whole PNG

  def tear(workdir):
    _tear_last_record(workdir)  # what a kill inside the append leaves
    kept[workdir][POINTS_FILE] = set(_by_key(_jsonl_lines(workdir / POINTS_FILE, complete=False)))

  def completed(workdir, run_again):
    if run_again:
      _run(shared, _sweep_command(workdir), tmp_path / f"{workdir.name}-completed.log")
    got = stored(workdir, complete=True)
    assert {name: set(records) for name, records in got.items()} == {name: set(r) for name, r in want.items()}
    with open(workdir / "results.csv") as f:
      assert len(list(csv.DictReader(io.StringIO(f.read())))) == len(want[POINTS_FILE])
    assert {name: (workdir / name).read_bytes() for name in RESULTS} == want_results

  def start_fresh():
    return tmp_path / f"sweep{next(fresh)}"

  # Killed before storing its third point, then (its second record torn) as the next run repaired points.jsonl: the
  # repair rewrote the file in place, so the kill lost every point stored before.
  targeted = [(f"3:{POINTS_FILE}", None), (f"1:{POINTS_FILE}", tear)]
  _sequence("sweep", stats, targeted, launch, after_kill, completed, start_fresh)
