"""ExFlow placement: counts against a plain loop, the solver against brute-force enumeration of all
balanced placements (and of the node-preserving ones the node routings allow), and applying a
placement against the unpermuted reference layer."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from moejax.moe import reference
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.placement import solve as solve_lib
from moejax.placement.affinity import affinity_counts, transitions
from moejax.placement.apply import apply_placement, expert_order
from moejax.placement.solve import solve
from moejax.validation import ConfigError
from tests.helpers import normal, random_params, relative_error

moe_reference = jax.jit(reference.moe_reference, static_argnames=("cfg", "dispatch_groups"))  # one compile per config


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


def _new_index(placement) -> np.ndarray:
  """[M, E]: the index expert e of layer j should have after `apply_placement`, counted one expert at a time:
  the block of its device placement[j, e], after the experts of the same device with lower ids."""
  place = np.asarray(placement)
  per_device = place.shape[1] // (int(place.max()) + 1)
  index = np.empty_like(place)
  for j, row in enumerate(place):
    filled = {}
    for e, device in enumerate(row.tolist()):
      index[j, e] = device * per_device + filled.get(device, 0)
      filled[device] = filled.get(device, 0) + 1
  return index


def _loop_crossings(counts, part):
  return sum(
    int(counts[j, a, b])
    for j in range(counts.shape[0])
    for a in range(counts.shape[1])
    for b in range(counts.shape[2])
    if part[j, a] != part[j + 1, b]
  )


def _brute_min(counts, parts):
  """Fewest crossings over every balanced split of every layer (L <= 3), by exhaustive enumeration."""
  num = counts.shape[1]
  assert counts.shape[0] <= 2
  splits = np.array(
    [s for s in itertools.product(range(parts), repeat=num) if all(s.count(p) == num // parts for p in range(parts))]
  )
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


@pytest.mark.parametrize(
  "layers,num,nodes,gpus,seed", [(2, 8, 2, 2, 2), (3, 8, 2, 1, 3), (2, 8, 4, 1, 4), (3, 4, 4, 1, 5), (2, 8, 2, 4, 6)]
)
@pytest.mark.sampled(1)
def test_solve_matches_brute_force(layers, num, nodes, gpus, seed):
  rng = np.random.default_rng(seed)
  counts = _random_counts(rng, layers, num, structure=40)
  result = solve(counts, nodes, gpus, time_limit_s=20)
  place = result.placement
  assert place.shape == (layers, num)
  for row in place:  # balanced: every device holds E / A experts of every layer
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
@pytest.mark.sampled(1)
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
  cases = [
    (counts[0], 2, 2, "counts.shape"),
    (counts[:, :, :6], 2, 2, "counts.shape"),
    (counts - 5, 2, 2, "counts"),
    (counts, 3, 1, "num_experts"),
    (counts, 2, 3, "num_experts"),
    (counts, 0, 2, "nodes"),
    (counts, 2, 1.5, "gpus_per_node"),
  ]
  for bad, nodes, gpus, field in cases:
    with pytest.raises(ConfigError) as err:
      solve(bad, nodes, gpus)
    assert err.value.field == field, (field, err.value)
  with pytest.raises(ConfigError, match="outside"):
    affinity_counts(np.array([[0, 8], [1, 2]]), 8)
  with pytest.raises(ConfigError, match="M >= 2"):
    affinity_counts(np.array([[0, 1]]), 8)


@pytest.mark.parametrize("gated", [False, True])
def test_apply_placement_keeps_outputs(gated):
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, gated=gated)
  rng = np.random.default_rng(12 + gated)
  layers = 3
  params = [random_params(cfg, 20 + j + 10 * gated) for j in range(layers)]
  placement = np.stack([rng.permutation(np.repeat(np.arange(4), 2)) for _ in range(layers)])  # 4 devices, 2 each
  moved = apply_placement(params, placement, cfg)
  index = _new_index(placement)
  x = normal(30 + gated, (64, 16))
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
  params = [random_params(flat, 2)]
  with pytest.raises(ConfigError) as err:  # without the config a node_limited layer looks like a top-k one
    apply_placement(params, placement, None)
  assert err.value.field == "cfg"
  with pytest.raises(ConfigError) as err:  # flat params under a bilevel config
    apply_placement(params, placement, bilevel)
  assert err.value.field == "params"
  with pytest.raises(ConfigError, match="unbalanced"):
    apply_placement(params, np.array([[0, 0, 0, 1, 1, 1, 1, 1]]), flat)
  with pytest.raises(ConfigError) as err:
    apply_placement(params * 2, placement, flat)
  assert err.value.field == "placement"
  with pytest.raises(ConfigError) as err:
    apply_placement(params, np.tile(np.arange(16) // 4, (1, 1)), flat)
  assert err.value.field == "placement"


# Node routings: which experts share a node is part of the model, so a placement may move a node's
# experts only together; 'bilevel' also needs one local order on every node (its shared local router).

NODES, GPUS = 2, 4


def _node_cfg(routing, **fields):
  base = dict(num_experts=16, top_k=2, d_model=16, d_ff=32, routing=routing, num_nodes=NODES)
  if routing == "bilevel":
    base["top_k"] = 1
  return MoEConfig(**{**base, **fields})


def _node_preserving(rng, layers, cfg, move_nodes):
  """[M, E] flat devices on the 2 x 4 mesh: each node's experts stay together (on a random node if
  move_nodes), spread over its GPUs in a random order; for 'bilevel' the same order on every node."""
  per_node, per_gpu = cfg.experts_per_node, cfg.num_experts // (NODES * GPUS)
  place = np.empty((layers, cfg.num_experts), np.int64)
  for j in range(layers):
    to = rng.permutation(NODES) if move_nodes else np.arange(NODES)
    shared = rng.permutation(per_node)
    for node in range(NODES):
      slot = shared if cfg.routing == "bilevel" else rng.permutation(per_node)
      place[j, node * per_node : (node + 1) * per_node] = to[node] * GPUS + slot // per_gpu
  return place


@pytest.mark.parametrize(
  "routing,move_nodes,cf,seed",
  [("node_limited", False, None, 40), ("node_limited", True, 1.0, 41), ("bilevel", True, None, 42)],
)
@pytest.mark.sampled(1)
def test_node_preserving_placement_keeps_the_layer(mesh_2x4, routing, move_nodes, cf, seed):
  """The placed layer on the 2 x 4 mesh against the reference layer on the original params: same
  outputs and drops, and every expert processes what it did, at its new index."""
  cfg = _node_cfg(routing, gated=True, capacity_factor=cf)
  rng = np.random.default_rng(seed)
  layers = 2
  params = [random_params(cfg, seed + 100 * j) for j in range(layers)]
  placement = _node_preserving(rng, layers, cfg, move_nodes)
  index = _new_index(placement)
  assert move_nodes or np.all(index // cfg.experts_per_node == np.arange(16) // cfg.experts_per_node)
  moved = apply_placement(params, placement, cfg)
  layer = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))
  for j in range(layers):
    x = normal(seed + 10 + j, (64, 16))
    y_ref, aux_ref = moe_reference(params[j], x, cfg, dispatch_groups=8)
    y, aux = layer(moved[j], x)
    assert relative_error(y, y_ref) < 1e-5 and np.abs(np.asarray(y_ref)).max() > 1e-2
    counts_ref = np.asarray(aux_ref["expert_counts"])
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"])[index[j]], counts_ref)
    assert int(aux["tokens_dropped"]) == int(aux_ref["tokens_dropped"])
    assert (cf is None) == (int(aux_ref["tokens_dropped"]) == 0)
    np.testing.assert_allclose(float(aux["aux_loss"]), float(aux_ref["aux_loss"]), rtol=1e-5)


def _relabelled(params, order_E):
  """params with expert order_E[i] moved to index i and its flat router column with it, unchecked."""
  return {
    "router": {"kernel": params["router"]["kernel"][:, order_E]},
    **{name: params[name][order_E] for name in ("w_in", "w_out")},
  }


def test_splitting_a_node_is_refused():
  cfg = _node_cfg("node_limited")
  params = random_params(cfg, 50)
  x = normal(51, (256, 16))
  placement = np.tile(np.arange(16) // 2, (2, 1))
  placement[1, [3, 12]] = placement[1, [12, 3]]  # layer 1: expert 3 to node 1, expert 12 to node 0
  with pytest.raises(ConfigError, match="expert 3 of MoE layer 1 from node 0 to node 1") as err:
    apply_placement([params, params], placement, cfg)
  assert err.value.field == "placement" and "node_limited ranks a token's nodes" in str(err.value)
  # Why: the same relabelling done anyway changes which experts the tokens reach.
  y = np.asarray(moe_reference(params, x, cfg)[0])
  y_split, aux_split = moe_reference(_relabelled(params, expert_order(placement)[1]), x, cfg)
  assert relative_error(y_split, y) > 1e-2
  flat = MoEConfig(**{**dataclasses.asdict(cfg), "routing": "topk", "num_nodes": None})  # no nodes: fine
  y_flat = np.asarray(moe_reference(params, x, flat)[0])
  moved = apply_placement([params, params], placement, flat)[1]
  assert relative_error(moe_reference(moved, x, flat)[0], y_flat) < 1e-5


def test_bilevel_needs_one_local_order():
  cfg = _node_cfg("bilevel")
  params = [random_params(cfg, 52)]
  placement = np.tile(np.arange(16) // 2, (1, 1))
  placement[0, [0, 2]] = placement[0, [2, 0]]  # node 0 reorders its experts (0, 1 | 2, 3 -> 1, 2 | 0, 3), node 1 not
  with pytest.raises(ConfigError, match="same local order") as err:
    apply_placement(params, placement, cfg)
  assert err.value.field == "placement" and "MoE layer 0" in str(err.value)
  assert "node 0 would hold its old local experts [1, 2, 0, 3, 4, 5, 6, 7] and node 1 [0, 1, 2, 3, 4, 5, 6, 7]" in str(
    err.value
  )
  placement[0, [8, 10]] = placement[0, [10, 8]]  # the same reordering on node 1: accepted
  apply_placement(params, placement, cfg)
  split = np.tile(np.arange(16) // 2, (1, 1))
  split[0, [1, 9]] = split[0, [9, 1]]
  with pytest.raises(ConfigError, match="bilevel picks a node") as err:
    apply_placement(params, split, cfg)
  assert err.value.field == "placement"


def _brute_node_min(counts, nodes):
  """Fewest cross-node transitions over every layer's permutation of whole nodes (contiguous groups)."""
  layers, per_node = counts.shape[0] + 1, counts.shape[1] // nodes
  best = None
  for perms in itertools.product(itertools.permutations(range(nodes)), repeat=layers):
    part = np.stack([np.repeat(p, per_node) for p in perms])
    cost = _loop_crossings(counts, part)
    best = cost if best is None else min(best, cost)
  return best


def _brute_shared_gpu_min(counts, node_of, gpus):
  """Fewest cross-GPU transitions over one balanced GPU layout of the local experts per layer, shared by
  every node, for the node of each expert node_of [L, E] (whole nodes)."""
  layers, num = node_of.shape
  nodes = node_of.max() + 1
  per_node = num // nodes
  splits = [
    s
    for s in itertools.product(range(gpus), repeat=per_node)
    if all(s.count(g) == per_node // gpus for g in range(gpus))
  ]
  return min(
    _loop_crossings(counts, node_of * gpus + np.stack([np.tile(s, nodes) for s in choice]))
    for choice in itertools.product(splits, repeat=layers)
  )


@pytest.mark.parametrize(
  "routing,layers,num,nodes,gpus,seed",
  [
    ("node_limited", 3, 8, 2, 2, 60),
    ("node_limited", 2, 12, 3, 2, 61),
    ("bilevel", 3, 8, 2, 2, 62),
    ("bilevel", 2, 16, 4, 2, 63),
  ],
)
def test_node_constrained_solve(routing, layers, num, nodes, gpus, seed):
  """solve(routing=...) keeps every node's experts together ('bilevel': one GPU layout for all nodes),
  is optimal over those placements (brute force) and no worse than the layers' own layout."""
  rng = np.random.default_rng(seed)
  counts = _random_counts(rng, layers, num, structure=40)
  result = solve(counts, nodes, gpus, time_limit_s=20, routing=routing)
  place, per_node = result.placement, num // nodes
  assert result.routing == routing and result.optimal
  for row in place:
    np.testing.assert_array_equal(np.bincount(row, minlength=nodes * gpus), num // (nodes * gpus))
    node_of = row.reshape(nodes, per_node) // gpus
    assert np.all(node_of == node_of[:, :1])  # whole nodes
    assert sorted(node_of[:, 0]) == list(range(nodes))
    if routing == "bilevel":
      gpu_of = row.reshape(nodes, per_node) % gpus
      assert np.all(gpu_of == gpu_of[:1])
  assert result.cross_node == _loop_crossings(counts, place // gpus) == _brute_node_min(counts, nodes)
  assert result.cross_gpu == _loop_crossings(counts, place)
  assert result.cross_node <= result.identity_cross_node
  contiguous = (place // gpus) * gpus + np.tile(np.arange(num) % per_node // (per_node // gpus), (layers, 1))
  assert result.cross_gpu <= _loop_crossings(counts, contiguous)  # stage 2 beats the nodes' own layout
  if routing == "bilevel":
    assert result.cross_gpu == _brute_shared_gpu_min(counts, place // gpus, gpus)
  else:
    intra = 0
    for node in range(nodes):
      members = [np.flatnonzero(place[j] // gpus == node) for j in range(layers)]
      intra += _brute_min(np.stack([counts[j][np.ix_(members[j], members[j + 1])] for j in range(layers - 1)]), gpus)
    assert result.cross_gpu - result.cross_node == intra
  cfg = MoEConfig(num_experts=num, top_k=1, d_model=8, d_ff=8, routing=routing, num_nodes=nodes)
  params = [random_params(cfg, seed + j) for j in range(layers)]
  moved = apply_placement(params, result, cfg)
  x = normal(seed, (32, 8))
  for j in range(layers):
    assert relative_error(moe_reference(moved[j], x, cfg)[0], moe_reference(params[j], x, cfg)[0]) < 1e-5


def test_unconstrained_placement_splits_nodes():
  """Counts whose best placement mixes two nodes' experts: the free solve does, and a node_limited
  layer refuses it, while the node-constrained solve keeps its nodes at a higher cross-node count."""
  num, nodes = 8, 2
  traces = np.empty((2, 400), np.int64)
  traces[0] = np.random.default_rng(70).integers(0, num, 400)
  traces[1] = np.array([4, 5, 2, 3, 0, 1, 6, 7])[traces[0]]  # half of node 0 continues on node 1, and back
  counts = affinity_counts(traces, num)
  free, kept = solve(counts, nodes, 1), solve(counts, nodes, 1, routing="node_limited")
  assert free.cross_node == 0 < kept.cross_node <= kept.identity_cross_node
  cfg = MoEConfig(num_experts=num, top_k=1, d_model=8, d_ff=8, routing="node_limited", num_nodes=nodes)
  params = [random_params(cfg, 71 + j) for j in range(2)]
  with pytest.raises(ConfigError) as err:
    apply_placement(params, free, cfg)
  assert err.value.field == "placement"
  with pytest.raises(ConfigError) as err:
    solve(counts, nodes, 1, routing="smile")
  assert err.value.field == "routing"


def test_apply_placement_keeps_outputs_with_zero_experts():
  """Zero-computation experts (ids 8 .. 9) have no parameters and no device: a placement moves the 8 real experts
  with their router columns and leaves the zero experts' columns last, so the outputs and the zero experts' counts
  stay as they were (hash routing's placement: tests/test_hash_routing.py)."""
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, zero_experts=2)
  rng = np.random.default_rng()
  params = [random_params(cfg, int(rng.integers(1 << 30)))]
  placement = rng.permutation(np.repeat(np.arange(4), 2))[None]
  moved = apply_placement(params, placement, cfg)
  x = normal(int(rng.integers(1 << 30)), (64, 16))
  y, aux = moe_reference(params[0], x, cfg)
  y_moved, aux_moved = moe_reference(moved[0], x, cfg)
  np.testing.assert_allclose(np.asarray(y_moved), np.asarray(y), atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux_moved["zero_expert_counts"]), np.asarray(aux["zero_expert_counts"]))
  assert np.asarray(aux["zero_expert_counts"]).sum() > 0  # some choices went to the zero experts
  np.testing.assert_array_equal(moved[0]["router"]["kernel"][:, 8:], params[0]["router"]["kernel"][:, 8:])
