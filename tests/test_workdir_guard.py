"""moejax.workdir_guard and the programs that use it: no program writes over another program's outputs (issue 61).

Each finding reproduced: an export into the training run's own workdir, a scaling sweep run again into its workdir
with another topology, plot_run given its workdir as the trainer prints it (a positional argument), and the programs
that write a record (compile_time, exchange_memory, fine_grained, tune_kernels, expert_table) into another's
workdir or over their own from another config."""

import importlib
import json
import shutil
import subprocess
import sys

import ml_collections
import pytest

from configs import decoder
from experiments import expert_table
from moejax import workdir_guard
from moejax.cost import expert_backend
from moejax.train import resume
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env
from tests.test_heldout import tiny_decoder_run
from tests.test_plot_run import _write_run


def _program(name: str, *args, timeout: int = 300):
  return subprocess.run(
    [sys.executable, "-m", f"experiments.{name}", *map(str, args)],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _refused(done, message: str) -> None:
  """The program exited with status 1 after one error line, `message`."""
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert done.returncode == 1 and errors == [f"error: {message}"], done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1] == f"error: {message}"


def _export_refusal(run) -> str:
  return f"{run} holds the outputs of a training run (experiments.train): use another --workdir for experiments.export"


def test_export_into_a_runs_workdir_is_refused_before_anything_is_written(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  resume.record(decoder.get_config(), str(run), 0)  # the config.json the trainer keeps: its versions and history
  kept = (run / "config.json").read_bytes()
  _refused(_program("export", f"--config.run={run}", f"--workdir={run}"), _export_refusal(run))
  assert (run / "config.json").read_bytes() == kept
  assert sorted(p.name for p in run.iterdir()) == ["config.json"]


@pytest.mark.slow  # the 3-step run of tests/test_heldout.py (shared), copied: this test must not touch the shared one
def test_export_into_a_trained_runs_workdir_leaves_its_config_json(shared, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(tiny_decoder_run(shared), run)
  kept = (run / "config.json").read_bytes()
  assert json.loads(kept)["history"] == [] and "versions" in json.loads(kept)
  _refused(_program("export", f"--config.run={run}", f"--workdir={run}"), _export_refusal(run))
  assert (run / "config.json").read_bytes() == kept
  assert workdir_guard.owner(str(run)) == {"program": workdir_guard.TRAINER, "settings": None}


# One scheme on a 1 x 2 mesh, a tiny model and small runs: seconds.
TINY_SWEEP = (
  "--config.schemes=switch",
  "--config.nodes=1",
  "--config.gpus_per_node=2",
  "--config.scalings=weak",
  "--config.models.small.d_model=32",
  "--config.models.small.d_ff=64",
  "--config.models.small.layers=2",
  "--config.models.small.moe_layers=1",
  "--config.models.small.seq_len=8",
  "--config.models.small.micro_batch=4",
  "--config.models.small.vocab=100",
  "--config.sim.tokens_per_gpu=8",
  "--config.sim.batches=2",
  "--config.sim.d_model=16",
  "--config.sim.d_ff=32",
)


@pytest.mark.slow  # three sweeps of one point each, as the program runs them
def test_a_sweep_rerun_with_another_topology_is_refused_and_keeps_the_results(tmp_path):
  workdir = tmp_path / "sweep"
  done = _program("scaling", f"--workdir={workdir}", *TINY_SWEEP)
  assert done.returncode == 0, done.stderr[-2000:]
  kept = {name: (workdir / name).read_bytes() for name in ("results.csv", "results.json", "throughput.png")}
  again = _program("scaling", f"--workdir={workdir}", *TINY_SWEEP, "--config.topology=dgx_h100_ib")
  _refused(
    again,
    f"{workdir} holds the outputs of a scaling sweep (experiments.scaling) with other settings (topology: "
    '"p4d_efa" there, "dgx_h100_ib" now); they are kept: use another --workdir for experiments.scaling',
  )
  assert {name: (workdir / name).read_bytes() for name in kept} == kept
  done = _program("scaling", f"--workdir={workdir}", *TINY_SWEEP)  # the same settings: resumed, results refreshed
  assert done.returncode == 0, done.stderr[-2000:]
  assert (workdir / "results.csv").read_bytes() == kept["results.csv"]


@pytest.mark.slow
def test_plot_run_takes_its_workdir_as_the_trainer_prints_it(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  _write_run(run, bias=False)
  done = _program("plot_run", run)
  assert done.returncode == 0, done.stderr[-2000:]
  assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert not (run / workdir_guard.MARKER).exists()  # the plot is the run's: its workdir is left unmarked
  other = tmp_path / "other"
  _refused(
    _program("plot_run", run, f"--workdir={other}"), f"two workdirs given, {run} and --workdir={other}: give one"
  )
  assert not other.exists()


def test_plot_run_never_writes_into_a_sweeps_workdir(tmp_path):
  run, sweep = tmp_path / "run", tmp_path / "sweep"
  run.mkdir()
  _write_run(run, bias=False)
  workdir_guard.claim(str(sweep), workdir_guard.SWEEP, {"nodes": [1]})
  done = _program("plot_run", f"--config.runs={run}", f"--workdir={sweep}")
  _refused(
    done,
    f"{sweep} holds the outputs of a scaling sweep (experiments.scaling): use another --workdir for "
    "experiments.plot_run",
  )
  assert sorted(p.name for p in sweep.iterdir()) == [workdir_guard.MARKER]


def test_unmarked_workdirs_are_recognised_by_what_they_hold(tmp_path):
  (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)  # a run from before config.json was kept
  (tmp_path / "hf").mkdir()
  for name in ("config.json", "model.safetensors"):
    (tmp_path / "hf" / name).write_text("{}")
  (tmp_path / "sweep").mkdir()
  (tmp_path / "sweep" / "points.jsonl").write_text("")
  (tmp_path / "empty").mkdir()
  owners = {name: workdir_guard.owner(str(tmp_path / name)) for name in ("run", "hf", "sweep", "empty", "missing")}
  assert {name: found and found["program"] for name, found in owners.items()} == {
    "run": workdir_guard.TRAINER,
    "hf": workdir_guard.EXPORT,
    "sweep": workdir_guard.SWEEP,
    "empty": None,
    "missing": None,
  }
  workdir_guard.claim(str(tmp_path / "sweep"), workdir_guard.SWEEP, {"nodes": [1, 2]})  # an old sweep: taken on
  assert workdir_guard.owner(str(tmp_path / "sweep"))["settings"] == {"nodes": [1, 2]}


def test_the_same_program_and_settings_go_on_other_settings_name_the_first_difference(tmp_path):
  workdir = str(tmp_path / "w")
  settings = {"topology": "p4d_efa", "nodes": (1, 2), "sim": {"batches": 2}}
  workdir_guard.claim(workdir, "experiments.fidelity", settings)
  workdir_guard.claim(workdir, "experiments.fidelity", settings)  # a rerun to refresh
  changed = {"topology": "p4d_efa", "nodes": (1, 4), "sim": {"batches": 3}}
  with pytest.raises(ConfigError, match=r"\(nodes: \[1, 2\] there, \[1, 4\] now and 1 more\); they are kept"):
    workdir_guard.claim(workdir, "experiments.fidelity", changed)
  with pytest.raises(ConfigError, match=f"^{workdir} holds the outputs of experiments.fidelity: use another"):
    workdir_guard.claim(workdir, workdir_guard.EXPORT, {"run": "/r"})
  assert workdir_guard.owner(workdir) == {
    "program": "experiments.fidelity",
    "settings": json.loads(json.dumps(settings)),
  }


def test_the_other_programs_refuse_a_runs_workdir_too(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  resume.record(decoder.get_config(), str(run), 0)
  kept = (run / "config.json").read_bytes()
  _refused(
    _program("fidelity", f"--workdir={run}", "--config.papers=ExFlow"),
    f"{run} holds the outputs of a training run (experiments.train): use another --workdir for experiments.fidelity",
  )
  assert sorted(p.name for p in run.iterdir()) == ["config.json"] and (run / "config.json").read_bytes() == kept


# The programs that write a record of their own into --workdir: each claims it with its config before any work.
RECORDS = {  # program: (an override of one field of its default config, that field's values there and now)
  "compile_time": ("--config.seq_len=16", "seq_len: 32 there, 16 now"),
  "exchange_memory": ("--config.nodes=8", "nodes: 16 there, 8 now"),
  "fine_grained": ("--config.repeats=2", "repeats: 5 there, 2 now"),
  "tune_kernels": ("--config.iters=2", "iters: 20 there, 2 now"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_record_programs_refuse_another_programs_workdir_and_a_changed_config(tmp_path, name):
  run, mine, program = tmp_path / "run", tmp_path / "mine", f"experiments.{name}"
  run.mkdir()
  (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a training run's
  _refused(  # refused at once: a short timeout (the default config's work takes minutes)
    _program(name, f"--workdir={run}", timeout=60),
    f"{run} holds the outputs of a training run (experiments.train): use another --workdir for {program}",
  )
  assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]
  workdir_guard.claim(str(mine), program, importlib.import_module(f"configs.{name}").get_config())  # its default's
  (mine / "earlier.json").write_text("{}")  # the results of that run
  override, change = RECORDS[name]
  _refused(
    _program(name, f"--workdir={mine}", override, timeout=60),
    f"{mine} holds the outputs of {program} with other settings ({change}); they are kept: use another --workdir "
    f"for {program}",
  )
  assert sorted(p.name for p in mine.iterdir()) == ["earlier.json", workdir_guard.MARKER]


H100 = ROOT / "benchmarks" / "results" / "2026-11-23-h100"


def test_expert_table_keeps_a_devices_table_of_other_records_but_replaces_a_shipped_one(tmp_path, monkeypatch):
  """One folder holds the tables of several devices: a rerun from the same records refreshes a table, one from other
  records is refused naming them; the folder stays unmarked (tables only). In the shipped folder a table replaces the
  shipped one (git keeps it)."""
  write = lambda records, workdir: expert_table.write(ml_collections.ConfigDict({"records": records}), str(workdir))
  mixtral, qwen = str(H100 / "kernels-mixtral_8x7b.json"), str(H100 / "kernels-qwen2_moe-smile.json")
  tables = tmp_path / "tables"
  write((mixtral,), tables)
  (table,) = tables.iterdir()
  kept = table.read_bytes()
  write((mixtral,), tables)
  with pytest.raises(ConfigError, match=rf"^{table} holds the table of other records \(records: \"kernels-mixtral"):
    write((qwen,), tables)
  assert list(tables.iterdir()) == [table] and table.read_bytes() == kept
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text("")
  with pytest.raises(ConfigError, match=f"^{run} holds the outputs of a training run"):
    write((mixtral,), run)
  shipped = tmp_path / "expert_tables"
  monkeypatch.setattr(expert_backend, "TABLES_DIR", str(shipped))
  write((mixtral,), shipped)
  write((qwen,), shipped)
  assert [p.name for p in shipped.iterdir()] == [table.name] and (shipped / table.name).read_bytes() != kept


def test_a_workdir_made_by_another_process_during_the_check_is_a_directory(tmp_path, monkeypatch):
  """The two-process job's race (CI, 2026-11-29): one process tests the workdir (missing), the other makes it, then
  the first finds it exists; it is a directory, not a file."""
  workdir = tmp_path / "run"
  real_isdir = workdir_guard.os.path.isdir
  asked = []

  def isdir_then_made(path):
    answer = real_isdir(path)
    if str(path) == str(workdir) and not asked:
      asked.append(path)
      workdir.mkdir()  # the other process, between this test and the next
    return answer

  monkeypatch.setattr(workdir_guard.os.path, "isdir", isdir_then_made)
  assert workdir_guard.not_a_directory(str(workdir)) is None
  assert asked and workdir.is_dir()
  file = tmp_path / "file"
  file.write_text("")
  assert workdir_guard.not_a_directory(str(file)).startswith("an existing file")
