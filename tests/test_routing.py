"""Routing's index math against plain Python loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import routing


@pytest.mark.parametrize("num_experts,tokens,k", [(8, 64, 2), (256, 128, 8), (4, 33, 3), (1, 5, 1)])
def test_queue_positions_follow_gshard_priority(num_experts, tokens, k):
  """Every first choice before any second choice, earlier tokens first within a rank (a loop over
  choices and tokens), on random and on all-to-one-expert routing."""
  rng = np.random.default_rng(num_experts + tokens)
  for ids in (rng.integers(0, num_experts, (tokens, k)), np.full((tokens, k), num_experts - 1)):
    want, seen = np.zeros_like(ids), {}
    for c in range(k):
      for t in range(tokens):
        want[t, c] = seen.get(ids[t, c], 0)
        seen[ids[t, c]] = want[t, c] + 1
    got = np.asarray(routing.queue_positions(jnp.asarray(ids, jnp.int32), num_experts))
    np.testing.assert_array_equal(got, want)
