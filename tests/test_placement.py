"""ExFlow placement: counts against a plain loop, the solver against brute-force enumeration of all
balanced placements, and applying a placement against the unpermuted reference layer."""

import itertools

import jax
import numpy as np
import pytest

from moejax.moe import reference
from moejax.moe.config import MoEConfig
from moejax.moe.layer import init_params
from moejax.placement import solve as solve_lib
from moejax.placement.affinity import affinity_counts, transitions
from moejax.placement.apply import apply_placement, new_index
from moejax.placement.solve import solve
from moejax.validation import ConfigError

moe_reference = jax.jit(reference.moe_reference, static_argnames="cfg")  # one compile per config


def _loop_counts(traces, num_experts):
  """counts[j, a, b] by a plain double loop over layer pairs and tokens (and the choice pairs)."""
  traces = np.asarray(traces)
  counts = np.zeros((traces.shape[0] - 1, num_experts, num_experts), np.int64)
  for j in range(traces.shape[0] - 1):
    for t in range(traces.shape[1]):
      for a in np.atleast_1d(traces[j, t]):
        for b in np.atleast_1d(traces[j + 1, t]):
          counts[j, a, b] += 1
  return counts


def _loop_crossings(counts, part):
  return sum(int(counts[j, a, b]) for j in range(counts.shape[0]) for a in range(counts.shape[1])
             for b in range(counts.shape[2]) if part[j, a] != part[j + 1, b])


def _brute_min(counts, parts):
  """Fewest crossings over every balanced split of every layer (L <= 3), by exhaustive enumeration."""
  num = counts.shape[1]
  assert counts.shape[0] <= 2
  splits = np.array([s for s in itertools.product(range(parts), repeat=num)
                     if all(s.count(p) == num // parts for p in range(parts))])
  onehot = np.eye(parts, dtype=np.int64)[splits]  # [S, E, P]
  flat = onehot.reshape(len(splits), -1)  # kept[s, t] = sum_{a,b,p} [s(a) = p] c[a, b] [t(b) = p]
  cost = [c.sum() - np.einsum("sap,ab->sbp", onehot, c).reshape(len(splits), -1) @ flat.T for c in counts]
  total = cost[0] if len(cost) == 1 else cost[0][:, :, None] + cost[1][None, :, :]
  return int(total.min())


def _random_counts(rng, layers, num, structure=0):
  counts = rng.integers(1, 30, (layers - 1, num, num))
  for c in counts:  # optional affinity: a heavy entry per row, on a random permutation
    c[np.arange(num), rng.permutation(num)] += structure
  return counts


def test_affinity_counts_matches_loop():
  rng = np.random.default_rng(1)
  traces = rng.integers(0, 6, (4, 50))
  counts = affinity_counts(traces, 6)
  np.testing.assert_array_equal(counts, _loop_counts(traces, 6))
  assert counts.dtype == np.int64 and counts.sum() == 3 * 50
  top2 = np.stack([[rng.choice(6, 2, replace=False) for _ in range(40)] for _ in range(3)])  # [L, T, K]
  np.testing.assert_array_equal(affinity_counts(top2, 6), _loop_counts(top2, 6))


@pytest.mark.parametrize("layers,num,nodes,gpus,seed", [(2, 8, 2, 2, 2), (3, 8, 2, 1, 3), (2, 8, 4, 1, 4),
                                                        (3, 4, 4, 1, 5), (2, 8, 2, 4, 6)])
def test_solve_matches_brute_force(layers, num, nodes, gpus, seed):
  rng = np.random.default_rng(seed)
  counts = _random_counts(rng, layers, num, structure=40)
  result = solve(counts, nodes, gpus, time_limit_s=20)
  place = result.placement
  assert place.shape == (layers, num)
  for row in place:  # balanced: every device holds E / D experts of every layer
    np.testing.assert_array_equal(np.bincount(row, minlength=nodes * gpus), num // (nodes * gpus))
  assert result.optimal and result.node_gap == 0 and result.node_bound == result.cross_node
  assert result.cross_node == _brute_min(counts, nodes) == _loop_crossings(counts, place // gpus)
  assert result.cross_gpu == _loop_crossings(counts, place)
  intra = 0  # stage 2: given the node sets, the fewest cross-GPU transitions inside each node
  for node in range(nodes):
    members = [np.flatnonzero(place[j] // gpus == node) for j in range(layers)]
    local = np.stack([counts[j][np.ix_(members[j], members[j + 1])] for j in range(layers - 1)])
    intra += 0 if gpus == 1 else _brute_min(local, gpus)
  assert result.cross_gpu - result.cross_node == intra
  identity = np.tile(np.arange(num) // (num // (nodes * gpus)), (layers, 1))
  assert result.identity_cross_node == _loop_crossings(counts, identity // gpus)
  assert result.identity_cross_gpu == _loop_crossings(counts, identity)
  assert result.transitions == counts.sum() and result.cross_node <= result.identity_cross_node


@pytest.mark.parametrize("layers,num,parts,structure,seed", [(2, 8, 2, 0, 7), (3, 8, 2, 0, 8), (2, 8, 4, 100, 9)])
def test_milp_alone_is_exact(layers, num, parts, structure, seed):
  """The ILP without the local search's incumbent: its optimum, and a cutoff below it is infeasible."""
  counts = _random_counts(np.random.default_rng(seed), layers, num, structure)
  best = _brute_min(counts, parts)
  part, bound = solve_lib._milp(counts, parts, 20, 0.0, cutoff=np.inf)
  assert _loop_crossings(counts, part) == best == bound
  np.testing.assert_array_equal(np.apply_along_axis(np.bincount, 1, part, minlength=parts), num // parts)
  assert solve_lib._milp(counts, parts, 20, 0.0, cutoff=best - 1) == (None, best)
  assert solve_lib._pair_bound(counts, parts) <= best


def test_structured_counts_need_no_crossing():
  rng = np.random.default_rng(10)
  layers, num = 4, 16
  traces = np.empty((layers, 500), np.int64)
  traces[0] = rng.integers(0, num, 500)
  for j in range(1, layers):  # expert a at layer j always goes on to sigma_j(a) at j+1
    traces[j] = rng.permutation(num)[traces[j - 1]]
  counts = affinity_counts(traces, num)
  result = solve(counts, 2, 2, time_limit_s=10)
  assert result.cross_node == 0 and result.cross_gpu == 0 and result.optimal
  assert result.identity_cross_gpu > 0
  assert transitions(counts, result.placement, 2) == (0, 0)


def test_errors_name_the_field():
  counts = np.random.default_rng(11).integers(1, 9, (2, 8, 8))
  cases = [(counts[0], 2, 2, "counts.shape"), (counts[:, :, :6], 2, 2, "counts.shape"),
           (counts - 5, 2, 2, "counts"), (counts, 3, 1, "num_experts"), (counts, 2, 3, "num_experts"),
           (counts, 0, 2, "nodes"), (counts, 2, 1.5, "gpus_per_node")]
  for bad, nodes, gpus, field in cases:
    with pytest.raises(ConfigError) as err:
      solve(bad, nodes, gpus)
    assert err.value.field == field, (field, err.value)
  with pytest.raises(ConfigError, match="outside"):
    affinity_counts(np.array([[0, 8], [1, 2]]), 8)
  with pytest.raises(ConfigError, match="L >= 2"):
    affinity_counts(np.array([[0, 1]]), 8)


@pytest.mark.parametrize("gated", [False, True])
def test_apply_placement_keeps_outputs(gated):
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, gated=gated)
  rng = np.random.default_rng(12 + gated)
  layers = 3
  params = [init_params(jax.random.key(20 + j + 10 * gated), cfg) for j in range(layers)]
  placement = np.stack([rng.permutation(np.repeat(np.arange(4), 2)) for _ in range(layers)])  # 4 devices, 2 each
  moved = apply_placement(params, placement, cfg)
  index = new_index(placement)
  x = jax.random.normal(jax.random.key(30 + gated), (64, 16))
  for j in range(layers):
    assert sorted(moved[j]) == sorted(params[j]) and ("w_gate" in moved[j]) == gated
    for e in range(8):  # expert e now sits at an index of its device's block, with its router column
      assert index[j, e] // 2 == placement[j, e]
      np.testing.assert_array_equal(moved[j]["w_in"][index[j, e]], params[j]["w_in"][e])
      np.testing.assert_array_equal(moved[j]["router"]["kernel"][:, index[j, e]], params[j]["router"]["kernel"][:, e])
    y, aux = moe_reference(params[j], x, cfg)
    y_moved, aux_moved = moe_reference(moved[j], x, cfg)
    np.testing.assert_allclose(np.asarray(y_moved), np.asarray(y), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux_moved["expert_counts"])[index[j]], np.asarray(aux["expert_counts"]))
    assert np.abs(np.asarray(y)).max() > 1e-2
  experts_only = {**moved[0], "router": params[0]["router"]}  # control: experts moved without the router
  y0 = np.asarray(moe_reference(params[0], x, cfg)[0])
  assert not np.allclose(np.asarray(moe_reference(experts_only, x, cfg)[0]), y0, atol=1e-3)


def test_apply_placement_errors():
  flat = MoEConfig(num_experts=8, top_k=1, d_model=16, d_ff=32)
  bilevel = MoEConfig(num_experts=8, top_k=1, d_model=16, d_ff=32, routing="bilevel", num_nodes=2)
  placement = np.tile(np.arange(8) // 2, (1, 1))
  with pytest.raises(ConfigError) as err:
    apply_placement([init_params(jax.random.key(0), bilevel)], placement)
  assert err.value.field == "routing"
  limited = MoEConfig(num_experts=8, top_k=1, d_model=16, d_ff=32, routing="node_limited", num_nodes=2)
  with pytest.raises(ConfigError) as err:
    apply_placement([init_params(jax.random.key(1), limited)], placement, limited)
  assert err.value.field == "routing"
  params = [init_params(jax.random.key(2), flat)]
  with pytest.raises(ConfigError, match="unbalanced"):
    apply_placement(params, np.array([[0, 0, 0, 1, 1, 1, 1, 1]]))
  with pytest.raises(ConfigError) as err:
    apply_placement(params * 2, placement)
  assert err.value.field == "placement"
