"""Lina's popularity estimator against a float64 count written with plain loops, on random, path-determined
and one-expert traces; the phase-2 rule; the moving average; errors that name the bad value."""

import numpy as np
import pytest

from moejax.replication import estimator
from moejax.replication import rebalance as rebalance_lib
from moejax.validation import ConfigError


def reference_tables(traces, experts, length, top_k):
  """{layer: ({path tuple: psi row [E]}, marginal [E])} by dictionaries and loops, in float64."""
  out = {}
  for layer in range(length, traces.shape[0]):
    rows, tokens = {}, {}
    for t in range(traces.shape[1]):
      path = tuple(int(traces[j, t, 0]) for j in range(layer - length, layer))
      rows.setdefault(path, np.zeros(experts, np.float64))
      tokens[path] = tokens.get(path, 0) + 1
      for e in traces[layer, t]:
        rows[path][int(e)] += 1.0
    marginal = sum(rows.values()) / traces.shape[1]
    psi = {}
    for path, row in rows.items():
      keep = sorted(range(experts), key=lambda e: (-row[e], e))[:top_k]
      psi[path] = np.array([row[e] / tokens[path] if e in keep else 0.0 for e in range(experts)])
    out[layer] = (psi, marginal)
  return out


def reference_estimate(tables, traces, experts, length):
  """[L - l, E]: per token its path's row, or the layer's marginal for an unseen path."""
  out = []
  for layer in range(length, traces.shape[0]):
    psi, marginal = tables[layer]
    total = np.zeros(experts, np.float64)
    for t in range(traces.shape[1]):
      path = tuple(int(traces[j, t, 0]) for j in range(layer - length, layer))
      total += psi.get(path, marginal)
    out.append(total)
  return np.stack(out)


@pytest.mark.parametrize("experts,length,choices,top_k", [(5, 1, 1, 1), (6, 2, 2, 1), (4, 3, 2, 2), (7, 2, 1, 3)])
def test_estimate_matches_a_float64_loop(experts, length, choices, top_k):
  rng = np.random.default_rng(experts * 100 + length * 10 + choices)
  skew = 1.0 / np.arange(1, experts + 1) ** 1.5
  for p in (None, skew / skew.sum()):  # uniform, then skewed ids
    profiled = rng.choice(experts, size=(5, 400, choices), p=p)
    held_out = rng.choice(experts, size=(5, 150, choices), p=p)
    tables = estimator.profile(profiled, experts, length, top_k)
    expected = reference_estimate(reference_tables(profiled, experts, length, top_k), held_out, experts, length)
    got = estimator.estimate_loads(tables, held_out)
    assert got.dtype == np.float64 and got.shape == (5 - length, experts)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-9)
    loads = estimator.true_loads(held_out, experts)
    np.testing.assert_array_equal(loads, [[np.sum(held_out[j] == e) for e in range(experts)] for j in range(5)])


def test_a_path_determined_routing_is_recovered_exactly():
  """Expert at layer j is a fixed function of the experts at j-2 and j-1: the estimate is the true load."""
  rng = np.random.default_rng(1)
  experts, layers = 6, 6
  shift = rng.integers(0, experts, size=layers)
  traces = np.empty((layers, 900), np.int64)
  traces[:2] = rng.choice(experts, size=(2, 900), p=np.arange(1, experts + 1) / 21)
  traces[:2, : experts**2] = np.divmod(np.arange(experts**2), experts)  # every path is profiled
  for j in range(2, layers):
    traces[j] = (2 * traces[j - 2] + traces[j - 1] + shift[j]) % experts
  tables = estimator.profile(traces[:, :600], experts, 2)
  held_out = traces[:, 600:]
  truth = estimator.true_loads(held_out, experts)[2:]
  np.testing.assert_array_equal(estimator.estimate_loads(tables, held_out), truth)
  records, dropped = estimator.plan_batches(tables, held_out, 100, 1, 3, 2)
  assert dropped == 0 and len(records) == 3 * (layers - 2)
  for r in records:
    assert r["accurate"] and not r["replanned"] and r["l1_lina"] == pytest.approx(0, abs=1e-15)
    np.testing.assert_array_equal(r["tables"]["lina_phase1"], r["tables"]["oracle"])


def test_every_token_on_one_expert():
  experts = 8
  traces = np.full((4, 64, 1), 5)
  tables = estimator.profile(traces, experts, 3)
  estimate = estimator.estimate_loads(tables, traces[:, :32])
  np.testing.assert_array_equal(estimate, [[0, 0, 0, 0, 0, 32, 0, 0]])
  records, _ = estimator.plan_batches(tables, traces, 32, 2, 2, 3)
  for r in records:
    assert r["accurate"] and not r["replanned"]
    plain = rebalance_lib.max_load_ratio(r["true"], r["tables"]["no_replication"])
    assert plain == pytest.approx(4.0)  # all 32 rows on one of 4 devices
    lina = rebalance_lib.max_load_ratio(r["true"], r["tables"]["lina_phase1"])
    assert lina == pytest.approx(rebalance_lib.max_load_ratio(r["true"], r["tables"]["oracle"])) and lina < 1.5


def test_phase2_keeps_the_plan_when_the_top_2k_sets_agree():
  true = np.array([50.0, 10, 40, 5, 1, 0])
  plan = {"calls": 0}

  def replan(load):
    plan["calls"] += 1
    return rebalance_lib.rebalance(load, 1, 3, 2)

  first = np.arange(6).reshape(3, 2)
  same_set = np.array([30.0, 1, 35, 2, 9, 0])  # top-2 {2, 0}: order and values differ from the truth
  table, replanned = estimator.phase2(same_set, true, first, 1, replan)
  assert table is first and not replanned and plan["calls"] == 0
  other_set = np.array([30.0, 31, 5, 2, 9, 0])  # top-2 {1, 0}
  table, replanned = estimator.phase2(other_set, true, first, 1, replan)
  assert replanned and plan["calls"] == 1
  np.testing.assert_array_equal(table, rebalance_lib.rebalance(true, 1, 3, 2))
  # with k = 2 choices the top-4 sets are compared: {0, 2, 1, 4} against the truth's {0, 2, 1, 3}
  assert estimator.phase2(other_set, true, first, 2, replan)[1]
  assert not estimator.phase2(np.array([9.0, 8, 7, 6, 1, 0]), true, first, 2, replan)[1]


def test_moving_average_and_l1_match_loops():
  rng = np.random.default_rng(2)
  loads = rng.integers(0, 100, size=(9, 5)).astype(float)
  for window in (1, 3, 20):
    got = estimator.moving_average(loads, window)
    np.testing.assert_array_equal(got[0], np.ones(5))
    for b in range(1, 9):
      recent = loads[max(0, b - window) : b]
      np.testing.assert_allclose(got[b], recent.sum(0) / len(recent), rtol=1e-12)
  a, b = rng.uniform(0.1, 1, 7), rng.uniform(0.1, 1, 7)
  assert estimator.l1_error(a, b) == pytest.approx(sum(abs(x / a.sum() - y / b.sum()) for x, y in zip(a, b)))
  assert estimator.l1_error([1.0, 0], [0, 3.0]) == pytest.approx(2.0)


def test_plan_batches_policies_and_dropped_tokens():
  rng = np.random.default_rng(3)
  traces = rng.choice(8, size=(5, 500, 2), p=np.arange(8, 0, -1) / 36)
  tables = estimator.profile(traces[:, :300], 8, 2)
  records, dropped = estimator.plan_batches(tables, traces[:, 300:], 60, 2, 2, 3, window=2)
  assert dropped == 200 - 3 * 60 and len(records) == 3 * 3
  assert set(records[0]["tables"]) == set(estimator.POLICIES)
  np.testing.assert_array_equal(records[0]["tables"]["no_replication"], np.arange(8).reshape(4, 2))
  for r in records:
    assert r["accurate"] == (not r["replanned"])
    expected = r["tables"]["oracle"] if r["replanned"] else r["tables"]["lina_phase1"]
    np.testing.assert_array_equal(r["tables"]["lina_phase2"], expected)
    tops = [set(sorted(range(8), key=lambda e, x=x: (-x[e], e))[:4]) for x in (r["moving_average"], r["true"])]
    assert r["accurate_moving_average"] == (tops[0] == tops[1])
    for table in r["tables"].values():
      assert set(table.ravel().tolist()) == set(range(8))


@pytest.mark.parametrize(
  "call,field",
  [
    (lambda: estimator.profile(np.zeros((3, 4)), 4), "traces.dtype"),
    (lambda: estimator.profile(np.full((3, 4), 4), 4), "traces"),
    (lambda: estimator.profile(np.zeros((3,), int), 4), "traces.shape"),
    (lambda: estimator.profile(np.zeros((3, 4), int), 4, path_length=3), "path_length"),
    (lambda: estimator.profile(np.zeros((3, 4), int), 4, path_length=1, top_k=0), "top_k"),
    (lambda: estimator.profile(np.zeros((3, 4), int), 0), "num_experts"),
    (
      lambda: estimator.estimate_loads(estimator.profile(np.zeros((3, 4), int), 4, 1), np.zeros((4, 4), int)),
      "traces.shape",
    ),
    (lambda: estimator.moving_average(np.ones((3, 2)), 0), "window"),
    (
      lambda: estimator.plan_batches(estimator.profile(np.zeros((3, 4), int), 4, 1), np.zeros((3, 4), int), 5, 1, 2, 2),
      "batch_tokens",
    ),
    (lambda: rebalance_lib.identity_table(6, 4), "num_experts"),
  ],
)
def test_bad_inputs_name_the_value(call, field):
  with pytest.raises(ConfigError) as info:
    call()
  assert info.value.field == field
