"""moejax.cli's start of every program: --print_config (the config with its overrides, as JSON, then exit; no
--workdir needed), and a quiet start (no "Unable to initialize backend" line for platforms that are not installed,
unless --verbosity asks for debug lines)."""

import ast
import json
import subprocess
import sys

import pytest

from tests.helpers import ENV, ROOT


def _program(module: str, *args: str, env=ENV) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )


def test_every_program_takes_print_config():
  """Every program that runs through cli.run defines its config with cli.define_config, which adds --print_config."""
  without = []
  for folder in ("experiments", "benchmarks"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      calls = {ast.unparse(node.func) for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}
      if "cli.run" in calls and "cli.define_config" not in calls:
        without.append(path.relative_to(ROOT).as_posix())
  assert without == []


@pytest.mark.slow
def test_print_config_prints_the_config_with_its_overrides_and_exits():
  done = _program(
    "experiments.train",
    "--config=configs/decoder.py:deepseek_v3",
    "--config.steps=7",
    "--config.moe.top_k=2",
    "--print_config",
  )  # no --workdir: nothing is run
  assert done.returncode == 0, done.stderr[-2000:]
  config = json.loads(done.stdout)
  assert (config["steps"], config["moe"]["top_k"], config["model"]["family"]) == (7, 2, "deepseek_v3")
  assert config["model"]["moe_layers"][:2] == [False, True]  # tuples as lists
  done = _program("experiments.scaling", "--config.nodes=1,2", "--print_config")
  assert done.returncode == 0 and json.loads(done.stdout)["nodes"] == [1, 2], done.stderr[-2000:]


@pytest.mark.slow
def test_print_config_still_checks_the_overrides():
  done = _program("experiments.demo", "--config.moe.top_kk=2", "--print_config")
  assert done.returncode == 1 and not done.stdout
  assert done.stderr.strip().endswith("unknown config field moe.top_kk (did you mean moe.top_k?)"), done.stderr


@pytest.mark.slow
def test_start_is_quiet_about_platforms_that_are_not_installed():
  """JAX probes every platform it knows; without JAX_PLATFORMS, a missing one was an INFO line in every program."""
  env = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}
  program = "import jax\nfrom moejax import cli\ncli.run(lambda argv: print(jax.devices()[0].platform))"
  done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and done.stdout.strip() in ("cpu", "gpu"), done.stderr[-2000:]
  assert "Unable to initialize backend" not in done.stderr, done.stderr
  # The lines are only hidden: asked for, they are there.
  debug = subprocess.run(
    [sys.executable, "-c", program, "--verbosity=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert debug.returncode == 0 and "Unable to initialize backend" in debug.stderr, debug.stderr[-2000:]
