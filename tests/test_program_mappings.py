"""The premise of tests/conftest.py's `pytest_runtest_teardown`: compiled CPU programs hold memory mappings while
jax's caches keep them, and clearing the caches gives them back (a worker that ran out of mappings crashed)."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import memory_mappings


def test_clearing_jaxs_caches_unmaps_the_programs_it_kept():
  if memory_mappings() == (0, 0):
    pytest.skip("no /proc/self/maps here")
  jax.clear_caches()
  gc.collect()
  before = memory_mappings()[0]
  program = jax.jit(lambda x: (jnp.sin(x) * 2 + 1).sum(0))
  for rows in range(1, 61):  # a program per shape, each kept (as the tests' op-by-op references keep one per op)
    program(np.full((rows, 3), 0.5, np.float32)).block_until_ready()
  kept = memory_mappings()[0] - before
  jax.clear_caches()
  gc.collect()
  left = memory_mappings()[0] - before
  assert kept >= 100, kept  # the premise: kept programs hold mappings (about 3 each)
  assert left < kept / 3, (kept, left)
