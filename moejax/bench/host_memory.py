"""Host memory and page cache of this process, read from Linux: the resident set (/proc/self/status, ru_maxrss)
sampled on a thread, and a directory's files dropped from, or counted in, the page cache (what
experiments/hf_load.py measures a checkpoint's load with)."""

import os
import resource
import threading
import time


def rss_status() -> dict:
  """Current RssAnon, RssFile and VmRSS of this process in bytes (Linux /proc)."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      key = line.split(":")[0]
      if key in ("RssAnon", "RssFile", "VmRSS"):
        out[key] = int(line.split()[1]) * 1024
  return out


def peak_rss() -> int:
  """ru_maxrss in bytes (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler:
  """Samples rss_status() every `interval` s on a thread; keeps the peak of each entry."""

  def __init__(self, interval: float = 0.005):
    self.interval, self.peak, self._stop = interval, rss_status(), threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      for key, value in rss_status().items():
        self.peak[key] = max(self.peak.get(key, 0), value)
      time.sleep(self.interval)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def drop_page_cache(directory: str) -> None:
  """Asks the kernel to drop the files' clean pages from the page cache (no privileges needed)."""
  for name in os.listdir(directory):
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def cached_fraction(directory: str) -> float:
  """Fraction of the safetensors files' pages in the page cache (mincore over a read-only mapping)."""
  import ctypes
  import mmap

  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype, libc.mmap.argtypes = (
    ctypes.c_void_p,
    (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long),
  )
  libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
  libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
  cached = total = 0
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    size = os.path.getsize(path)
    if not name.endswith(".safetensors") or not size:
      continue
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
      address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
      vec = ctypes.create_string_buffer(pages)
      if libc.mincore(address, size, vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore {path}")
      libc.munmap(address, size)
    finally:
      os.close(fd)
    cached += sum(byte & 1 for byte in vec.raw[:pages])
    total += pages
  return cached / max(total, 1)
