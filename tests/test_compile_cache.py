"""The persistent compilation cache that the workers, the subprocesses and concurrent runs share (tests/conftest.py)
is safe without a lock: processes compiling the same programs into one cache at once agree, and an entry caught half
written is read as a miss (compiled again), never loaded."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
out = []
for n in range(8):  # eight programs, compiled (or read back) by every process at once
  f = jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum(axis=0))
  out.append(np.asarray(f(jnp.arange(64.0).reshape(8, 8) / 64)))
np.save(sys.argv[1], np.stack(out))
"""
EXPECTED = np.stack([np.tanh(x @ x.T + n).sum(axis=0) for x in [np.arange(64.0).reshape(8, 8) / 64] for n in range(8)])


def _env(cache: pathlib.Path) -> dict:
  return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _entries(cache: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))


@pytest.mark.slow
def test_concurrent_processes_share_one_cache_dir(tmp_path):
  cache, outputs = tmp_path / "cache", [tmp_path / f"out{i}.npy" for i in range(4)]
  runs = [
    subprocess.Popen([sys.executable, "-c", PROGRAM, str(o)], env=_env(cache), stderr=subprocess.PIPE) for o in outputs
  ]
  errors = [run.communicate(timeout=240)[1].decode()[-2000:] for run in runs]
  assert [run.returncode for run in runs] == [0] * 4, errors
  for output in outputs:
    np.testing.assert_allclose(np.load(output), EXPECTED, rtol=1e-5)
  assert len(_entries(cache)) >= 8


@pytest.mark.slow
def test_a_half_written_entry_is_compiled_again_not_loaded(tmp_path):
  cache, output = tmp_path / "cache", tmp_path / "out.npy"
  first = subprocess.run([sys.executable, "-c", PROGRAM, str(output)], env=_env(cache), capture_output=True, text=True)
  assert first.returncode == 0, first.stderr[-2000:]
  entries = _entries(cache)
  assert len(entries) >= 8
  for entry in entries:  # as a reader finds an entry another process is still writing
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
  output.unlink()
  again = subprocess.run([sys.executable, "-c", PROGRAM, str(output)], env=_env(cache), capture_output=True, text=True)
  assert again.returncode == 0, again.stderr[-2000:]
  assert "Error reading persistent compilation cache entry" in again.stderr  # each torn entry refused, then compiled
  np.testing.assert_allclose(np.load(output), EXPECTED, rtol=1e-5)


def test_the_cache_is_used_only_from_the_first_jaxlib_that_runs_collectives_from_it():
  from moejax.runtime import compile_cache

  # 0.10.2 deadlocked on a training step loaded from the cache, 0.12.0.1 ran it (moejax.runtime.compile_cache)
  assert [compile_cache.safe(v) for v in ("0.10.2", "0.11.2", "0.12.0.1", "0.13.0", "1.0.0")] == [
    False,
    False,
    True,
    True,
    True,
  ]
