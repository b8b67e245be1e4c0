"""`moejax.runtime.host_allocator`: with freed memory kept, a program whose temp buffer is above glibc's mmap threshold
and a thread arena's heap stops faulting its pages in every run (each case a process of its own: the setting is
process-wide), from its first run: the heap's touched reserve takes the growth a fragmented heap needs."""

import json
import subprocess
import sys

import pytest

from moejax.runtime import host_allocator

PAGE = 4096


def faults(mode: str) -> dict:
  done = subprocess.run(
    [sys.executable, "tests/programs/page_faults.py", mode], capture_output=True, text=True, check=True, timeout=120
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_memory_stops_the_page_faults_of_every_run():
  default = faults("default")
  pages = default["temp_bytes"] / PAGE
  assert default["temp_bytes"] > 64 * 2**20  # above every mmap threshold glibc picks and a thread arena's 64 MiB
  assert min(default["faults"]) > 0.5 * pages  # without it, the temp buffer's pages fault in every run
  kept = faults("retain")
  if kept["refused"]:
    pytest.skip(kept["refused"])
  assert max(kept["faults"]) < 0.01 * pages, kept  # none of its runs, the first included


@pytest.mark.parametrize("reserve", [-1, 2**31])
def test_a_reserve_glibc_would_trim_is_refused(reserve):
  with pytest.raises(ValueError, match=f"reserve_bytes={reserve}"):
    host_allocator.retain_freed_memory(reserve)
