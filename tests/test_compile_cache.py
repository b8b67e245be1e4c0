"""The persistent compilation cache that the workers, the subprocesses and concurrent runs share is read and written
under jax's file lock (tests/conftest.py sets a size limit; without one jax writes entries in place, unlocked)."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
out = []
for n in range(8):  # eight programs, compiled (or read back) by every process at once
  f = jax.jit(lambda x, n=n: jnp.tanh(x @ x.T + n).sum(axis=0))
  out.append(np.asarray(f(jnp.arange(64.0).reshape(8, 8) / 64)))
np.save(sys.argv[1], np.stack(out))
"""


def test_the_test_session_uses_the_locked_cache():
  assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert jax.config.jax_compilation_cache_max_size > 0  # > 0: jax takes its file lock around each read and write


def test_concurrent_processes_share_one_cache_dir(tmp_path):
  cache = tmp_path / "cache"
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  outputs = [tmp_path / f"out{i}.npy" for i in range(4)]
  runs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(o)], env=env, stderr=subprocess.PIPE) for o in outputs]
  errors = [run.communicate(timeout=240)[1].decode()[-2000:] for run in runs]
  assert [run.returncode for run in runs] == [0] * 4, errors
  first = np.load(outputs[0])
  for other in outputs[1:]:
    np.testing.assert_array_equal(np.load(other), first)
  expected = [np.tanh(x @ x.T + n).sum(axis=0) for x in [np.arange(64.0).reshape(8, 8) / 64] for n in range(8)]
  np.testing.assert_allclose(first, np.stack(expected), rtol=1e-5)
  entries = [p for p in pathlib.Path(cache).iterdir() if p.name.endswith("-cache")]
  assert len(entries) >= 8 and (cache / ".lockfile").exists()
