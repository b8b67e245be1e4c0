"""The local multi-process launcher: real 2-process jobs with jax.distributed (gloo) on localhost."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ENV, ROOT


def launch(*command, processes=2, timeout=240, options=()):
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "moejax.runtime.launch",
      "--processes",
      str(processes),
      "--devices-per-process",
      "4",
      *options,
      "--",
      *command,
    ],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_two_processes_run_collectives_over_the_host_boundary():
  run = launch(sys.executable, "tests/programs/collective_check.py")
  assert run.returncode == 0, run.stdout + run.stderr
  results = {}
  for line in run.stdout.splitlines():
    prefix, _, payload = line.partition(" ")
    if payload.startswith("RESULT "):
      result = json.loads(payload[len("RESULT ") :])
      assert prefix == f"[p{result['process']}]"  # output carries its process prefix
      results[result["process"]] = result
  assert sorted(results) == [0, 1]
  values = np.arange(64, dtype=np.float32).reshape(8, 8) ** 1.5
  for process, result in results.items():
    assert len(result["devices"]) == 4
    for row, block in result["all_to_all"].items():
      row = int(row)  # device `row` receives column `row` of every device's block
      np.testing.assert_allclose(np.asarray(block)[0], values[:, row], rtol=1e-6)
      assert row // 4 == process  # mesh row = host
    for row, block in result["node_psum"].items():
      row = int(row)
      np.testing.assert_allclose(np.asarray(block)[0], values[row % 4] + values[4 + row % 4], rtol=1e-6)


def test_failing_process_fails_the_job_with_its_code():
  code = "import os, sys, time; rank = int(os.environ['MOEJAX_PROCESS_ID']); time.sleep(0.5 * rank); sys.exit(3 * rank)"
  run = launch(sys.executable, "-c", code, timeout=60)
  assert run.returncode == 3
  assert "process 1 exited with 3" in run.stdout


def _sleeping_job() -> tuple[subprocess.Popen, list[int]]:
  """A launcher running 2 processes that sleep, and their pids (read from its '[launch] process i pid N' lines)."""
  proc = subprocess.Popen(
    [sys.executable, "-m", "moejax.runtime.launch", "--processes", "2", "--devices-per-process", "1", "--"]
    + [sys.executable, "-c", "import time; time.sleep(600)"],
    cwd=ROOT,
    env=ENV,
    stdout=subprocess.PIPE,
    text=True,
  )
  pids = []
  while len(pids) < 2:
    line = proc.stdout.readline()
    assert line, "launcher ended before starting its processes"
    if line.startswith("[launch] process"):
      pids.append(int(line.split()[-1]))
  return proc, pids


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
    return f.read().rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_killed_process_makes_the_launcher_exit_nonzero_quickly():
  proc, pids = _sleeping_job()
  os.kill(pids[1], signal.SIGKILL)
  start = time.monotonic()
  proc.wait(timeout=60)
  assert time.monotonic() - start < 60
  assert proc.returncode == 137  # 128 + SIGKILL, the killed child's fate
  _assert_gone_soon(pids)


def _assert_gone_soon(pids: list[int]) -> None:
  deadline = time.monotonic() + 30
  while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not [pid for pid in pids if _alive(pid)], "the job's processes outlived their launcher"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_killed_launcher_takes_its_processes_with_it():
  """A launcher killed from outside (a test's timeout killed one in CI, 2026-12-02) leaves no process of its job."""
  proc, pids = _sleeping_job()
  assert all(_alive(pid) for pid in pids)
  proc.kill()
  proc.wait(timeout=60)
  _assert_gone_soon(pids)


def test_usage_error_without_command():
  run = subprocess.run(
    [sys.executable, "-m", "moejax.runtime.launch", "--processes", "2"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert run.returncode == 2 and "usage" in run.stderr


def test_help_exits_zero():
  run = subprocess.run(
    [sys.executable, "-m", "moejax.runtime.launch", "--help"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert run.returncode == 0 and "--processes" in run.stdout


def test_a_refusal_on_one_process_stops_the_job_without_a_collective_timeout():
  """Process 0 exits on its ConfigError at once (not through jax.distributed's shutdown barrier, which waits for
  process 1, itself waiting in a collective for process 0 until gloo's 30 s timeout): the job ends with the error line
  and no timeout traceback from process 1 (CI, 2026-11-29: the trainer's workdir check refused on one process)."""
  run = launch(sys.executable, "tests/programs/refuse_on_one_process.py", timeout=120)
  assert run.returncode == 1, run.stdout + run.stderr
  assert "[p0] error: --workdir=/x: refused on process 0 only" in run.stdout.splitlines(), run.stdout
  assert "process 0 exited with 1" in run.stdout
  assert "DEADLINE_EXCEEDED" not in run.stdout and "RESULT" not in run.stdout, run.stdout


def test_each_process_runs_on_cores_of_its_own():
  """--cores-per-process 1: process i (and every thread it starts) on the i-th core this job may use; more cores than
  there are is one error line naming the value."""
  code = (
    "import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); "
    "t.start(); t.join(); print('cores', os.environ['MOEJAX_PROCESS_ID'], sorted(os.sched_getaffinity(0)), sorted(seen[0]))"
  )
  available = sorted(os.sched_getaffinity(0))
  if len(available) < 2:
    pytest.skip(f"two processes on a core each need two cores; this job may use {available}")
  run = launch(sys.executable, "-c", code, timeout=60, options=("--cores-per-process", "1"))
  assert run.returncode == 0, run.stdout[-2000:]
  for rank in (0, 1):
    assert f"[p{rank}] cores {rank} [{available[rank]}] [{available[rank]}]" in run.stdout
  too_many = len(available)
  bad = launch(sys.executable, "-c", "pass", timeout=60, options=("--cores-per-process", str(too_many)))
  assert bad.returncode == 2
  assert (
    bad.stderr.strip().splitlines()[-1].startswith(f"moejax.runtime.launch: cores_per_process={too_many}: 2 processes")
  )
