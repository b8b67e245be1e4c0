"""JAX's persistent compilation cache, used only where this jaxlib runs what it loads from it.

With jaxlib 0.10.2 (the newest on Python 3.11), a training step loaded from the cache deadlocked on CPU, in one
process: its devices waited at an all-reduce and at a collective permute under one rendezvous key (op_id 1 for both)
until XLA aborted the process; compiled afresh, the same step ran. On the 2-process job, a job whose process 0 loaded
the sweep's training step hung the same way. With jaxlib 0.12.0.1 the step ran from the cache (tests/test_fsdp.py's
step, twice on one cache: 53 s cold, 17 s warm). Not imported with jax, so a test setup can decide before jax reads
its environment.
"""

from importlib import metadata

from absl import logging

SAFE_FROM = (0, 12)  # the first jaxlib seen to run collectives loaded from the cache (above)


def safe(jaxlib_version: str | None = None) -> bool:
  """Whether `jaxlib_version` (default: the installed jaxlib's) is SAFE_FROM or newer."""
  version = jaxlib_version or metadata.version("jaxlib")
  return tuple(int(part) for part in version.split(".")[:2]) >= SAFE_FROM


def use(directory: str) -> bool:
  """Caches every compiled program in `directory` where `safe()`; returns whether it does (logged either way)."""
  import jax  # noqa: PLC0415 (the module stays importable before jax)

  if not safe():
    logging.info(
      "no persistent compilation cache: jaxlib %s runs collectives loaded from it wrongly (< %s)",
      metadata.version("jaxlib"),
      ".".join(map(str, SAFE_FROM)),
    )
    return False
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return True
