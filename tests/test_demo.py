"""experiments.demo: overflow reported beside capacity drops and named when it explains a difference from the
reference; esp_schedule='auto' resolved for the demo's tokens and mesh. The demo defines the global --config flag
at import, so it is imported in a subprocess (another experiment's module may hold that flag here)."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ENV, ROOT


def in_demo(code: str) -> dict:
  """The JSON that `code` prints, run after `from experiments import demo` in a fresh interpreter."""
  script = "import json, sys\nsys.argv = ['demo']\nfrom experiments import demo\n" + textwrap.dedent(code)
  run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_validate_resolves_auto_and_names_the_moe_field():
  out = in_demo("""
      from configs import demo as demo_config
      config = demo_config.get_config()
      config.moe.esp_schedule = "auto"
      resolved = demo.validate(config).esp_schedule
      config.moe.esp_cost = "nowhere"
      try:
        demo.validate(config)
      except demo.ConfigError as e:
        field = e.field
      print(json.dumps({"resolved": resolved, "field": field}))
  """)
  assert out["field"] == "moe.esp_cost" and out["resolved"] in ("s1", "s2")


def test_report_and_explanation_name_overflow_and_drops():
  out = in_demo("""
      from configs import demo as demo_config
      config = demo_config.get_config()
      overflow = {"tokens_overflowed": 965, "tokens_dropped": 0, "reference_tokens_dropped": 0,
                  "buffer_factor": "0.05"}
      drops = {"tokens_overflowed": 0, "tokens_dropped": 12, "reference_tokens_dropped": 40, "buffer_factor": "None"}
      neither = {**drops, "reference_tokens_dropped": 12}
      print(json.dumps({"line": demo.lost_choices(overflow, config), "overflow": demo.explain_difference(overflow),
                        "drops": demo.explain_difference(drops), "neither": demo.explain_difference(neither)}))
  """)
  assert out["line"] == (
    "token-choices dropped: 0 (capacity, moe.capacity_factor=None), overflowed: 965 "
    "(bounded receive buffers, moe.buffer_factor=0.05)"
  )
  assert out["overflow"].startswith("965 token-choices overflowed the bounded receive buffers (moe.buffer_factor=0.05")
  assert out["drops"].startswith("capacity dropped 12 token-choices, the reference 40 (moe.capacity_factor)")
  assert out["neither"].startswith("neither overflow nor capacity drops explain it")


@pytest.mark.slow
def test_small_buffers_end_in_one_line_naming_the_overflow():
  run = subprocess.run(
    [sys.executable, "-m", "experiments.demo", "--config.moe.buffer_factor=0.05", "--config.steps=1"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 1 and "Traceback" not in run.stderr
  overflowed = int(run.stdout.split("overflowed: ")[1].split()[0])
  assert overflowed > 0
  last = [line for line in run.stderr.splitlines() if line.strip()][-1]
  assert last.startswith("error: output differs from the reference by ")
  assert f"{overflowed} token-choices overflowed the bounded receive buffers (moe.buffer_factor=0.05" in last


@pytest.mark.slow
def test_auto_schedule_runs_and_prints_its_choice():
  run = subprocess.run(
    [sys.executable, "-m", "experiments.demo", "--config.moe.esp_schedule=auto", "--config.steps=1"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr
  assert "moe.esp_schedule='auto' resolved to 's" in run.stdout
  assert "overflowed: 0 (worst-case receive buffers)" in run.stdout
