"""tests/crash_rerun.py under xdist's loadgroup scheduling: a test whose worker dies once is run again on a fresh
worker and the run passes, reporting the rerun; one that kills its worker every time fails and stops the run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRASHING_TESTS = """
import os
import pytest

@pytest.mark.xdist_group("grouped")
@pytest.mark.parametrize("i", range(4))
def test_in_a_group(i):
  mark = os.path.join(os.environ["CRASH_DIR"], f"crashed-{i}")
  if i == int(os.environ["CRASH_AT"]) and (os.environ["CRASH_ALWAYS"] == "1" or not os.path.exists(mark)):
    open(mark, "w").close()
    os.abort()

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
  assert i >= 0
"""


def _run(tmp_path, crash_always: bool) -> subprocess.CompletedProcess:
  (tmp_path / "test_crashing.py").write_text(CRASHING_TESTS)
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # this run's, which hang the inner one
  env.update(PYTHONPATH=ROOT, CRASH_DIR=str(tmp_path), CRASH_AT="1", CRASH_ALWAYS=str(int(crash_always)))
  command = [sys.executable, "-m", "pytest", "-p", "tests.crash_rerun", "-p", "no:cacheprovider", "-n", "2"]
  command += ["--dist", "loadgroup", "--max-worker-restart=4", "-q", "test_crashing.py"]
  return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.sampled(1)
@pytest.mark.parametrize("crash_always", [False, True])
def test_a_crashed_worker_s_test_is_run_once_more(tmp_path, crash_always):
  done = _run(tmp_path, crash_always)
  out = done.stdout + done.stderr
  crashed = "worker 'gw"
  if crash_always:
    assert done.returncode != 0, out
    assert "1 failed" in out and "1 rerun" in out and "crashed its worker twice" in out, out
  else:
    assert done.returncode == 0, out
    assert "10 passed" in out and "1 rerun" in out and "failed" not in out, out
    assert f"RERUN {crashed}" in out and "test_crashing.py::test_in_a_group[1]@grouped" in out, out
