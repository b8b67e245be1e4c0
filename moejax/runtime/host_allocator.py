"""Keeping freed host memory in the process, so that a timed CPU program does not pay the kernel's page faults.

On CPU, XLA allocates each run's buffers (the program's temp buffer, its outputs) with the C library's malloc, from
the device threads. glibc serves a request above its mmap threshold (at most 32 MiB) with a fresh mapping, unmapped
when freed, and a thread's arena gives back a heap of its own that a free empties; either way every run of a program
whose temp buffer is large touches new pages: one minor fault and a zeroed page per 4 KiB, every run, on every
device. The MoE layer's forward+backward on the 2 x 4 simulated mesh (16 experts, widths 128 and 192, 2048 tokens:
55 and 83 MiB of temp a device) took 113,000 and 170,000 faults a run (312 and 552 ms); with freed memory kept,
none (165 and 410 ms). A GPU never pays this (XLA's GPU allocator pools device memory), and the cost model does
not price it: a measurement on CPU that includes it times the kernel's page zeroing, not the program.

`retain_freed_memory()` tells glibc to serve every request from its one main heap (no mapping per request, no
thread arenas) and never to give freed memory back: a program's pages fault in its first runs only. The process
keeps its peak memory until it exits, as XLA's GPU allocator does. Call it before any JAX computation: a device
thread that has taken an arena of its own keeps it. In 10-30% of processes on a 2-core test machine the
kept runs still faulted every page of a 49-98 MiB temp buffer (cause not found; `tests/test_host_allocator.py`). The measuring commands (`experiments.scaling`,
`experiments.validate_program_price`, `experiments.collective_chains`) call it first.
"""

import ctypes
import ctypes.util

from absl import logging

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
_INT_MAX = 2**31 - 1


def retain_freed_memory() -> str | None:
  """Tells the C library to keep freed memory (module docstring). None when done; else why not (not glibc: the
  setting is glibc's), also logged as a warning: the timings then include the page faults."""
  name = ctypes.util.find_library("c")
  libc = ctypes.CDLL(name) if name else None
  if libc is None or not hasattr(libc, "gnu_get_libc_version"):
    why = f"the C library {name!r} is not glibc; freed memory goes back to the system as it decides"
  elif not all(libc.mallopt(p, v) for p, v in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_ARENA_MAX, 1))):
    why = "glibc's mallopt refused M_MMAP_MAX=0, M_TRIM_THRESHOLD=INT_MAX or M_ARENA_MAX=1"
  else:
    return None
  logging.warning("host memory not kept (%s): CPU timings include each run's page faults", why)
  return why
