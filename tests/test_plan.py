"""The plan's index math against a NumPy model of ragged all-to-all, on random destinations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import plan as plan_lib
from tests import ragged_sim


@pytest.mark.parametrize("num_peers,rows,seed", [(8, 12, 0), (4, 7, 1), (2, 5, 2), (1, 3, 3), (5, 1, 4)])
def test_plan_paths_every_row_and_back(num_peers, rows, seed):
  rng = np.random.default_rng(seed)
  dest = [rng.integers(0, num_peers + 1, rows) for _ in range(num_peers)]  # value num_peers = not sent
  dest[0][:] = 0  # one device sends everything to peer 0, skewing the sizes
  orders, sends = zip(*(plan_lib.sort_by_destination(jnp.asarray(d), num_peers) for d in dest))
  sizes = np.stack([np.asarray(s) for s in sends])
  for s in range(num_peers):
    np.testing.assert_array_equal(sizes[s], np.bincount(dest[s], minlength=num_peers + 1)[:num_peers])
  args = [plan_lib.ragged_args(jnp.asarray(sizes), me) for me in range(num_peers)]

  ids = [1000 * (s + 1) + np.arange(rows) for s in range(num_peers)]  # unique, non-zero row values
  sorted_ids = [ids[s][np.asarray(orders[s])] for s in range(num_peers)]
  capacity = num_peers * rows
  received = ragged_sim.ragged_all_to_all(sorted_ids, [np.zeros(capacity, int)] * num_peers, [a[0] for a in args])
  for p in range(num_peers):
    expected = np.concatenate([ids[s][dest[s] == p] for s in range(num_peers)])
    np.testing.assert_array_equal(received[p][: len(expected)], expected)
    assert not received[p][len(expected) :].any()

  returned = ragged_sim.ragged_all_to_all(received, [np.zeros(rows, int)] * num_peers, [a[1] for a in args])
  for s in range(num_peers):
    restored = np.zeros(rows, int)
    restored[np.asarray(orders[s])] = returned[s]
    np.testing.assert_array_equal(restored, np.where(dest[s] < num_peers, ids[s], 0))


def test_permute_rows_and_its_gradient_are_the_permutation_and_its_inverse():
  """x[order] with the inverse's gather as the backward: the same values and gradient (against a float64
  NumPy loop) as autodiff's x[order], on a random permutation of random rows."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(9, 3)).astype(np.float32)
  weights = rng.normal(size=(9, 3)).astype(np.float32)  # a cotangent that differs row by row
  order = jnp.asarray(rng.permutation(9), jnp.int32)
  inverse = plan_lib.inverse_permutation(order)
  np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(9))
  loss = lambda x: jnp.sum(weights * jnp.sin(plan_lib.permute_rows(x, order, inverse)))
  np.testing.assert_array_equal(np.asarray(plan_lib.permute_rows(jnp.asarray(x), order, inverse)), x[order])
  want = np.zeros((9, 3))
  for i, j in enumerate(np.asarray(order)):  # row i of the output came from row j
    want[j] = weights[i] * np.cos(x[j].astype(np.float64))
  np.testing.assert_allclose(np.asarray(jax.grad(loss)(jnp.asarray(x))), want, rtol=1e-5)
