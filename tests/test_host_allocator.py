"""`moejax.runtime.host_allocator`: with freed memory kept, a program whose temp buffer is above glibc's mmap threshold
and a thread arena's heap
stops faulting its pages in every run (each case a process of its own: the setting is process-wide)."""

import json
import subprocess
import sys

import pytest

PAGE = 4096


def faults(mode: str) -> dict:
  done = subprocess.run(
    [sys.executable, "tests/programs/page_faults.py", mode], capture_output=True, text=True, check=True, timeout=120
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_memory_stops_the_page_faults_of_every_run():
  kept = faults("retain")
  if kept["refused"]:
    pytest.skip(kept["refused"])
  default = faults("default")
  pages = default["temp_bytes"] / PAGE
  assert default["temp_bytes"] > 64 * 2**20  # above every mmap threshold glibc picks and a thread arena's 64 MiB
  assert default["faults_per_run"] > 0.5 * pages  # without it, the temp buffer's pages fault in every run
  assert kept["faults_per_run"] < 0.01 * pages
