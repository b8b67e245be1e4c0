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
thread arenas) and never to give freed memory back, then grows that heap by `reserve_bytes` of touched pages and
frees them. The reserve is needed: one heap fragments, and a run whose small allocations split the last run's freed
temp buffer takes a new one from the heap's top, whose pages fault in; a program with a 98 MiB temp buffer grew the
heap by 98 MiB, every page faulted, in 0-5 of its first 8 runs (in 11 of 12 processes; `tests/test_host_allocator.py`)
before the heap settled. With the reserve the heap grows into pages already touched (none of them faulted once). The
process keeps its peak memory and the reserve, resident, until it exits, as XLA's GPU allocator keeps its pool. Call
it before any JAX computation: a device thread that has taken an arena of its own keeps it. The measuring commands
(`experiments.scaling` when it times anything, `experiments.validate_program_price`, `experiments.collective_chains`)
call it first.
"""

import ctypes
import ctypes.util

from absl import logging

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
_INT_MAX = 2**31 - 1
RESERVE_BYTES = 1 << 30  # the heap's touched headroom: five times the fragmentation seen on a 98 MiB temp buffer


def retain_freed_memory(reserve_bytes: int = RESERVE_BYTES) -> str | None:
  """Tells the C library to keep freed memory and touches `reserve_bytes` of heap (module docstring). None when
  done; else why not (not glibc: the setting is glibc's), also logged as a warning: the timings then include the
  page faults."""
  if not 0 <= reserve_bytes < _INT_MAX:  # a free top above the trim threshold would be given back
    raise ValueError(f"reserve_bytes={reserve_bytes} must be in [0, 2**31 - 1)")
  name = ctypes.util.find_library("c")
  libc = ctypes.CDLL(name) if name else None
  if libc is None or not hasattr(libc, "gnu_get_libc_version"):
    why = f"the C library {name!r} is not glibc; freed memory goes back to the system as it decides"
  elif not all(libc.mallopt(p, v) for p, v in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_ARENA_MAX, 1))):
    why = "glibc's mallopt refused M_MMAP_MAX=0, M_TRIM_THRESHOLD=INT_MAX or M_ARENA_MAX=1"
  else:
    _touch_and_free(libc, reserve_bytes)
    return None
  logging.warning("host memory not kept (%s): CPU timings include each run's page faults", why)
  return why


def _touch_and_free(libc, size: int) -> None:
  """Grows the main heap by `size` bytes of faulted-in pages, then frees them to its top (kept: never trimmed)."""
  if size == 0:
    return
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  block = libc.malloc(size)
  if not block:
    raise MemoryError(f"could not reserve {size} bytes of host memory for the heap")
  ctypes.memset(block, 1, size)  # written, so every page is faulted in now (calloc could skip fresh pages)
  libc.free(block)
