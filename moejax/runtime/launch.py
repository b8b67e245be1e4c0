"""Runs one command as N local JAX processes that form a single multi-process job.

    python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python my_program.py

Each process gets the coordinator address, its process id and its CPU device count in the
environment; the program calls `moejax.runtime.distributed.initialize()` first. Output is forwarded line by
line with a `[pN]` prefix. With `--cores-per-process K` process i runs on the host's cores i*K .. (i+1)*K - 1 only
(its threads too), as a host of its own would. On the 2-core CPU job, unpinned, each process's gloo event loop kept a
core busy and both processes' threads shared both cores, so a collective after another cost 0.1 to 4 ms by chance;
pinned, about 4 ms every time, and a 1 x 4 mesh had one core (docs/cost-model.md). If any process exits non-zero (or is killed), the others are killed and the
launcher exits non-zero at once, so a failed job never hangs in a collective; if the launcher itself is killed, so are
its processes (Linux).
"""

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# The names of the environment variables through which each process learns its place in the job.
ENV_COORDINATOR = "MOEJAX_COORDINATOR"
ENV_NUM_PROCESSES = "MOEJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "MOEJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "MOEJAX_LOCAL_DEVICES"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _forward(stream, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
    sys.stdout.flush()


def _kill_all(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for proc in procs:
    proc.wait()


def process_cores(processes: int, cores_per_process: int) -> list[list[int]]:
  """Each process's cores: consecutive blocks of `cores_per_process` of the cores this process may run on; ValueError
  naming the value where they do not hold processes x cores_per_process."""
  cores = sorted(os.sched_getaffinity(0))
  if cores_per_process < 1 or processes * cores_per_process > len(cores):
    raise ValueError(
      f"cores_per_process={cores_per_process}: {processes} processes x {cores_per_process} cores need that many of "
      f"the {len(cores)} cores this job may use ({cores})"
    )
  return [cores[i * cores_per_process : (i + 1) * cores_per_process] for i in range(processes)]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _in_child(cores: list[int] | None) -> None:
  """Run in each process before it starts the command: on `cores` only where given, and killed with the launcher
  (Linux), so a launcher that is itself killed (a test's timeout, a scheduler) leaves no process of the job spinning in
  gloo's loop."""
  if cores is not None:
    os.sched_setaffinity(0, cores)
  if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start(command: list[str], job: dict, cores: list[int] | None) -> subprocess.Popen:
  """One process of the job: `job`'s variables in its environment, on `cores` only where given, killed with the
  launcher (`_in_child`)."""
  env = {**os.environ, **job, "PYTHONUNBUFFERED": "1"}
  # Each child leads its own process group, so killing it also kills anything it started.
  proc = subprocess.Popen(
    command,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    stdin=subprocess.DEVNULL,
    start_new_session=True,
    preexec_fn=lambda: _in_child(cores),
  )
  on = "" if cores is None else f" on cores {','.join(map(str, cores))}"
  print(f"[launch] process {job[ENV_PROCESS_ID]} pid {proc.pid}{on}", flush=True)
  return proc


def launch(
  command: list[str],
  processes: int,
  devices_per_process: int,
  timeout: float | None = None,
  cores_per_process: int | None = None,
) -> int:
  """Runs `command` as `processes` cooperating processes, each pinned to `cores_per_process` cores of its own where
  given (`process_cores`); returns the job's exit code."""
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"processes and devices_per_process must be >= 1, got {processes}, {devices_per_process}")
  if not command:
    raise ValueError("no command given: put it after `--`")
  pinned = None if cores_per_process is None else process_cores(processes, cores_per_process)
  port = _free_port()
  procs, threads = [], []
  for rank in range(processes):
    job = {
      ENV_COORDINATOR: f"127.0.0.1:{port}",
      ENV_NUM_PROCESSES: str(processes),
      ENV_PROCESS_ID: str(rank),
      ENV_LOCAL_DEVICES: str(devices_per_process),
    }
    proc = _start(command, job, None if pinned is None else pinned[rank])
    procs.append(proc)
    thread = threading.Thread(target=_forward, args=(proc.stdout, f"[p{rank}] "), daemon=True)
    thread.start()
    threads.append(thread)

  deadline = None if timeout is None else time.monotonic() + timeout
  exit_code = 0
  try:
    while True:
      codes = [proc.poll() for proc in procs]  # poll every process: each must be reaped to be seen
      failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        rank, code = failed[0]
        print(f"[launch] process {rank} exited with {code}; stopping the job", flush=True)
        exit_code = code if code > 0 else 128 - code
        break
      if all(code == 0 for code in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        print(f"[launch] timeout after {timeout} s; killing all processes", flush=True)
        exit_code = 124
        break
      time.sleep(0.1)
  finally:
    _kill_all(procs)
    for thread in threads:
      thread.join(timeout=5)
  return exit_code


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  split = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(
    prog="python -m moejax.runtime.launch",
    description=__doc__.splitlines()[0],
    usage="%(prog)s [--processes N] [--devices-per-process D] [--cores-per-process K] [--timeout S] -- COMMAND...",
  )
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices-per-process", type=int, default=4)
  parser.add_argument(
    "--cores-per-process", type=int, default=None, help="pin process i to cores i*K .. (i+1)*K - 1 (default: unpinned)"
  )
  parser.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1 :]
  if not command:
    parser.error("no COMMAND given after '--'")
  try:
    return launch(command, args.processes, args.devices_per_process, args.timeout, args.cores_per_process)
  except ValueError as e:
    print(f"moejax.runtime.launch: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  sys.exit(main())
