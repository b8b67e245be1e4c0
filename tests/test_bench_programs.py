"""The benchmark programs on their command lines (experiments/bench_kernels.py, tune_kernels.py,
bench_collectives.py, expert_table.py; experiments/gpu_suite.py, hf_load.py): `--config` and `--workdir` only (and
`--print_config`), a bad field one error line naming it, and each writing its record to the workdir; no program
defines other flags, and no library code imports experiments/."""

import ast
import json
import subprocess
import sys

import pytest
from absl import flags

from moejax import cli
from moejax.bench import kernel_cases
from moejax.validation import ConfigError
from tests.helpers import ENV, ROOT, cpu_env


def _calls(tree) -> set[str]:
  """The dotted names called in `tree` (e.g. 'flags.DEFINE_string', 'argparse.ArgumentParser')."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
      names.add(f"{node.func.value.id}.{node.func.attr}")
  return names


def _modules(*folders):
  for folder in folders:
    for path in sorted((ROOT / folder).rglob("*.py")):
      yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_no_program_defines_flags_beyond_config_workdir_and_print_config():
  """Flags come from moejax.cli alone (define_config, define_workdir): no absl flag or argparse option elsewhere, and
  cli's are --config, --workdir and --print_config."""
  own = {
    name
    for name, tree in _modules("experiments", "benchmarks")
    if any(c.startswith("flags.DEFINE_") or c == "argparse.ArgumentParser" for c in _calls(tree))
  }
  assert own == set()
  values = flags.FlagValues()
  cli.define_config(str(ROOT / "configs" / "plot_run.py"), "a config", flag_values=values)
  cli.define_workdir("a workdir", flag_values=values)
  assert set(values) == {"config", "workdir", "print_config"}
  for name in (
    "experiments/bench_kernels.py",
    "experiments/tune_kernels.py",
    "experiments/bench_collectives.py",
    "experiments/expert_table.py",
    "experiments/gpu_suite.py",
    "experiments/hf_load.py",
  ):
    assert {"cli.define_config", "cli.define_workdir"} <= _calls(ast.parse((ROOT / name).read_text())), name


def test_benchmarks_holds_no_python():
  """benchmarks/ keeps the GPU suite's shell scripts, its results and README: the programs are in experiments/, what
  they measure with in moejax/bench/."""
  assert not list((ROOT / "benchmarks").rglob("*.py"))


def test_nothing_outside_tests_and_experiments_imports_experiments():
  importers = set()
  for name, tree in _modules("moejax", "kernels", "configs", "benchmarks"):
    for node in ast.walk(tree):
      modules = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else []
      )
      if any(m.removeprefix("moejax.").split(".")[0] == "experiments" for m in modules):
        importers.add(name)
  assert importers == set()


def run(program: str, *args, timeout=300) -> subprocess.CompletedProcess:
  """`program` (experiments.<module>, or a script) with `args`, on CPU."""
  command = [sys.executable, "-m", program] if not program.endswith(".py") else [sys.executable, program]
  return subprocess.run(
    [*command, *args],
    cwd=ROOT,
    env={**cpu_env(), "PYTHONPATH": ENV["PYTHONPATH"]},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.parametrize(
  "program,override,message",
  [
    (
      "experiments.bench_kernels",
      "--config.models=mixtral_8x7b,nope",
      "config field models='mixtral_8x7b,nope' is not allowed: a subset of ['mixtral_8x7b'",
    ),
    ("experiments.tune_kernels", "--config.kernels=gmm,nope", "config field kernels='gmm,nope' is not allowed"),
    ("experiments.bench_collectives", "--config.variants=flat,nope", "config field variants='flat,nope' is not"),
    ("experiments.expert_table", "--config.records=", "config field records=() is not allowed: one or more"),
    ("experiments.gpu_suite", "--config.step=nope", "config field step='nope' is not allowed: one of ['env'"),
    ("experiments.hf_load", "--config.param_dtype=float16", "config field param_dtype='float16' is not allowed"),
    (
      "experiments.compile_time",
      "--config.families=qwen3_moe,nope",
      "config field families=('qwen3_moe', 'nope') is not allowed: a non-empty tuple of [",
    ),
    ("experiments.compile_time", "--config.batch_size=12", "config field batch_size=12 is not allowed: a multiple of"),
  ],
)
@pytest.mark.sampled(1)
def test_a_bad_field_is_one_error_line_naming_it(tmp_path, program, override, message):
  done = run(program, f"--workdir={tmp_path}", override)
  assert done.returncode == 1, done.stdout + done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
  assert not list(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.slow
def test_the_workdir_is_required():
  done = run("experiments.bench_kernels")
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
    "error: flag --workdir=None: Flag --workdir must have a value other than None."
  ], done.stderr


@pytest.mark.parametrize(
  "shape,message",
  [
    (("16", "32", "2"), "not enough values to unpack"),
    (("16", "32", "2", "1", "relu2"), "ACTIVATION one of"),
    (("16", "x", "2", "1", "silu"), "invalid literal for int"),
  ],
)
def test_a_bad_custom_shape_names_the_field_and_its_form(shape, message):
  with pytest.raises(ConfigError, match=rf"^config field shape={','.join(shape)} is not allowed: .*{message}") as e:
    kernel_cases.custom_model(shape)
  assert e.value.field == "shape"
  assert kernel_cases.custom_model(("16", "32", "2", "1", "silu")) == dict(
    d=16, f=32, experts=2, top_k=1, gated=True, activation="silu"
  )


def test_expert_table_writes_the_shipped_table_from_its_records(tmp_path):
  results = ROOT / "benchmarks" / "results" / "2026-11-23-h100"
  records = ",".join(
    str(results / n)
    for n in ("kernels-mixtral_8x7b.json", "kernels-mixtral_8x7b-tuned-tiles.json", "kernels-qwen2_moe-smile.json")
  )
  done = run("experiments.expert_table", f"--workdir={tmp_path}", f"--config.records={records}")
  assert done.returncode == 0, done.stderr
  (table,) = tmp_path.iterdir()
  shipped = ROOT / "moejax" / "cost" / "expert_tables" / table.name
  assert json.loads(table.read_text())["shapes"] == json.loads(shipped.read_text())["shapes"]


@pytest.mark.slow  # compiles each case (about 30 s on 2 CPU cores)
def test_bench_kernels_smoke_writes_its_record_and_the_backend_table(tmp_path):
  done = run(
    "experiments.bench_kernels",
    f"--workdir={tmp_path}",
    "--config.smoke=True",
    "--config.ops=ffn",
    "--config.impls=ragged_dot,pallas_unfused",
    "--config.skews=balanced",
    "--config.backend_table=True",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "kernels.json").read_text())
  assert record["smoke"] is True and record["iters"] == 3
  cases = {(e["model"], e["impl"], e["passes"]) for e in record["results"] if "median_s" in e}
  assert cases == {
    (m, i, p)
    for m in ("smoke_gated", "smoke_plain")
    for i in ("ragged_dot", "pallas_unfused")
    for p in ("fwd", "fwd_bwd")
  }
  table = json.loads((tmp_path / "backend_table.json").read_text())
  assert {row["model"] for row in table["shapes"]} == {"smoke_gated", "smoke_plain"} and table[
    "source"
  ] == "kernels.json"


@pytest.mark.slow  # interprets the Pallas kernel for each candidate
def test_tune_kernels_smoke_writes_timings_and_the_table(tmp_path):
  done = run("experiments.tune_kernels", f"--workdir={tmp_path}", "--config.smoke=True", "--config.kernels=gmm")
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "tune_kernels.json").read_text())
  assert {r["shape_class"] for r in record["records"]} == {"many_rows", "few_rows"}
  assert set(record["best"]) == {"gmm/bf16/many_rows", "gmm/bf16/few_rows"}
  assert "('gmm', 'bf16', 'many_rows'): TileConfig(" in (tmp_path / "tune_kernels_table.txt").read_text()


@pytest.mark.slow
def test_bench_collectives_writes_checked_timings_and_fits(tmp_path):
  done = run(
    "experiments.bench_collectives",
    f"--workdir={tmp_path}",
    "--config.rows=1,4",
    "--config.variants=flat,padded,gpu_all_reduce",
    "--config.warmup=1",
    "--config.iters=2",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "collectives.json").read_text())
  assert record["mesh"] == [2, 4] and record["iters"] == 2
  assert {(e["variant"], e["rows_per_peer"]) for e in record["results"]} == {
    (v, r) for v in ("flat", "padded", "gpu_all_reduce") for r in (1, 4)
  }
  assert all(e.get("matches_first_variant", e.get("matches_reference")) for e in record["results"])
  assert set(record["fits"]) == {"flat", "padded", "gpu_all_reduce"}


@pytest.mark.slow  # three processes: the writer and two loads (about 45 s)
def test_hf_load_writes_its_record_and_removes_the_checkpoint(tmp_path):
  tiny = dict(
    layers=1, experts=8, top_k=2, d_model=64, moe_d_ff=32, vocab=256, heads=4, kv_heads=2, head_dim=16, shard_mb=1
  )
  done = run("experiments.hf_load", f"--workdir={tmp_path}", *(f"--config.{k}={v}" for k, v in tiny.items()))
  assert done.returncode == 0, done.stderr[-3000:]
  assert [p.name for p in tmp_path.iterdir()] == ["hf_load.json"]  # the checkpoint removed (config.keep False)
  record = json.loads((tmp_path / "hf_load.json").read_text())
  assert [load["cache"] for load in record["loads"]] == ["cold", "warm"]
  assert all(load["check_equal"] for load in record["loads"])
  assert record["shapes"]["moe"]["num_experts"] == 8 and record["shard_mb"] == 1


@pytest.mark.slow  # two compiles of the train step on the 2 x 4 mesh (about 30 s on 2 CPU cores)
def test_compile_time_writes_its_table_and_record(tmp_path):
  """experiments.compile_time on its default 2 x 4 mesh, one family at 2 layers scanned: the warm-up left out, the one
  point in the table and in compile_time.json."""
  done = run(
    "experiments.compile_time",
    f"--workdir={tmp_path}",
    "--config.families=qwen3_moe",
    "--config.layers=2",
    "--config.scan=True",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "compile_time.json").read_text())
  assert record["device"] == "2 x 4 simulated CPU devices" and record["config"]["layers"] == [2]
  (point,) = record["points"]
  assert (point["family"], point["layers"], point["scan_layers"]) == ("qwen3_moe", 2, True)
  assert point["total_cpu_s"] > 0 and point["compile_s"] > 0 and point["program_lines"] > 0
  (row,) = [line.split() for line in done.stdout.splitlines() if line.startswith("qwen3_moe")]  # the table's row
  assert row[:2] == ["qwen3_moe", "2"] and row[3] == "1.00x" and row[-1] == str(point["program_lines"])
