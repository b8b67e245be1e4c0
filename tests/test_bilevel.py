"""SMILE bi-level routing and DeepSeek-V3 node-limited routing: exact against the reference, the
additive load-balancing loss, and the collectives the compiled program issues."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from tests.helpers import assert_matches_reference, force_routing, normal, random_params
from tests.numpy_moe import moe_numpy


def _cfg(n, m, experts_per_gpu, **fields):
  base = dict(
    num_experts=n * m * experts_per_gpu,
    top_k=1,
    d_model=8,
    d_ff=12,
    routing="bilevel",
    num_nodes=n,
    path="node_first",
    z_loss_coef=1e-3,
  )
  return MoEConfig(**{**base, **fields})


@pytest.mark.parametrize("n,m", [(2, 4), (4, 2), (1, 8), (8, 1), (2, 2)])
@pytest.mark.parametrize("experts_per_gpu,cf", [(1, None), (2, 2.0)])
@pytest.mark.sampled(1)
def test_bilevel_layer_matches_reference(n, m, experts_per_gpu, cf):
  cfg = _cfg(n, m, experts_per_gpu, capacity_factor=cf, gated=experts_per_gpu == 2)
  seed = 10 * n + m + experts_per_gpu
  params = random_params(cfg, seed)
  x = normal(seed + 1, (n * m * 8, 8))
  assert_matches_reference(cfg, mesh_lib.make_mesh(n, m), params, x)


@pytest.mark.parametrize("path,cf", [("node_first", None), ("node_first", 2.0), ("flat", 1.0), ("gpu_first", None)])
@pytest.mark.sampled(1)
def test_one_node_receives_everything(mesh_2x4, path, cf):
  cfg = _cfg(2, 4, 2, path=path, capacity_factor=cf, node_top_k=1, top_k=2)
  params = random_params(cfg, 3)
  x = jnp.asarray(normal(4, (64, 8))).at[:, 0].set(1.0)
  kernel = jnp.asarray(params["node_router"]["kernel"]).at[0, 1].set(30.0)  # every token picks node 1
  params = {**params, "node_router": {"kernel": kernel}}
  _, aux = assert_matches_reference(cfg, mesh_2x4, params, x)
  counts = np.asarray(aux["expert_counts"])
  assert counts[:8].sum() == 0 and counts[8:].sum() == 64 * 2 - int(aux["tokens_dropped"])
  traffic = np.asarray(aux["traffic_rows"])
  if path == "node_first":
    assert traffic[0][:, :4].sum() == 0  # the inter-node hop delivers only to node 1


@pytest.mark.parametrize("node_top_k,top_k,cf", [(2, 2, None), (2, 1, 2.0), (1, 2, None)])
@pytest.mark.slow
def test_generalised_bilevel_and_node_limited(mesh_2x4, node_top_k, top_k, cf):
  for routing in ("bilevel", "node_limited"):
    k = top_k if routing == "bilevel" else top_k * node_top_k
    # Renormalised bi-level weights with one node (or one local expert) cancel p (or q) exactly, leaving
    # that router's gradient to fp32 rounding; raw weights keep every gradient meaningful.
    cfg = _cfg(
      2,
      4,
      2,
      routing=routing,
      node_top_k=node_top_k,
      top_k=k,
      capacity_factor=cf,
      renormalize=routing == "node_limited",
    )
    params = random_params(cfg, node_top_k * 10 + top_k)
    x = normal(5, (64, 8))
    assert_matches_reference(cfg, mesh_2x4, params, x)


def test_node_limited_keeps_choices_on_the_chosen_nodes(mesh_2x4):
  cfg = MoEConfig(num_experts=16, top_k=3, d_model=8, d_ff=12, routing="node_limited", num_nodes=2, node_top_k=1)
  params = random_params(cfg, 6)
  x = normal(7, (64, 8))
  _, aux = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(params, x)
  probs = jax.nn.softmax(np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64), -1)
  probs = np.asarray(probs).reshape(64, 2, 8)
  best_node = np.argmax(np.sort(probs, -1)[..., -2:].sum(-1), -1)
  want = np.zeros(16, int)
  for t in range(64):
    for e in np.argsort(-probs[t, best_node[t]])[:3]:
      want[best_node[t] * 8 + e] += 1
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), want)


@pytest.mark.parametrize("cf", [None, 1.0])
@pytest.mark.sampled(1)
def test_reference_matches_numpy_for_bilevel(cf):
  cfg = _cfg(2, 4, 2, node_top_k=2, top_k=2, capacity_factor=cf, gated=True, activation="silu")
  params = random_params(cfg, 8)
  x = normal(9, (32, 8))
  y, aux = moe_reference(params, x, cfg, dispatch_groups=4)
  y_np, dropped, counts = moe_numpy(params, x, cfg, dispatch_groups=4)
  np.testing.assert_allclose(np.asarray(y), y_np, rtol=1e-5, atol=1e-6)
  assert int(aux["tokens_dropped"]) == dropped and (cf is None) == (dropped == 0)
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), counts)


def test_additive_loss_formula_minimum_and_skew(mesh_2x4):
  cfg = _cfg(2, 4, 2, load_balance_coef=0.02, local_balance_coef=0.03)
  params = random_params(cfg, 10)
  x = normal(11, (64, 8))
  loss = lambda p, x: float(jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(p, x)[1]["load_balance_loss"])

  # Eq. 4 in float64 NumPy.
  def softmax(name):
    z = np.asarray(x, np.float64) @ np.asarray(params[name]["kernel"], np.float64)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)

  p, q = softmax("node_router"), softmax("local_router")
  f_i, f_j = np.bincount(p.argmax(-1), minlength=2) / 64, np.bincount(q.argmax(-1), minlength=8) / 64
  want = 0.02 * 2 * np.sum(f_i * p.mean(0)) + 0.03 * 8 * np.sum(f_j * q.mean(0))
  np.testing.assert_allclose(loss(params, x), want, rtol=1e-5)

  # Uniform routing (P, Q uniform) gives exactly alpha + beta, whatever the argmax fractions.
  zero = jax.tree.map(jnp.zeros_like, params)
  uniform = {**params, "node_router": zero["node_router"], "local_router": zero["local_router"]}
  np.testing.assert_allclose(loss(uniform, x), 0.02 + 0.03, rtol=1e-6)

  # Skew: every token to node 0 and local expert 0 with near-certainty.
  skewed, x_skew = force_routing(params, x, [0], strength=40.0, router="node_router")
  skewed, x_skew = force_routing(skewed, x_skew, [0], strength=40.0, router="local_router")
  skewed_loss = loss(skewed, x_skew)
  assert skewed_loss > 0.02 + 0.03
  np.testing.assert_allclose(skewed_loss, 0.02 * 2 + 0.03 * 8, rtol=1e-3)  # f = P = one-hot


def test_paper_default_coefficients():
  assert (_cfg(2, 4, 1).alpha, _cfg(2, 4, 1).beta) == (0.005, 0.005)
  assert MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=8).alpha == 0.01


def _permutes(cfg, mesh):
  """(dtype, source-target pairs) of every collective permute in the compiled program (the padded
  exchange is a ring of them)."""
  params = random_params(cfg, 0)
  x = normal(1, (64, 8))
  hlo = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile().as_text()
  found = []
  for line in hlo.splitlines():
    if re.search(r"\bcollective-permute(-start)?\(", line):
      dtype = re.search(r"=\s*\(?(\w+)\[", line).group(1)
      pairs = re.search(r"source_target_pairs=(\{[\d,{}]*\})", line).group(1)
      found.append((dtype, frozenset(tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", pairs))))
  return found


def _hop(pairs, gpus=4):
  """'node' if every pair links the same GPU of two nodes, 'gpu' if two GPUs of one node, else 'any'."""
  if all(s % gpus == t % gpus and s // gpus != t // gpus for s, t in pairs):
    return "node"
  if all(s // gpus == t // gpus for s, t in pairs):
    return "gpu"
  return "any"


def test_bilevel_exchanges_over_node_and_gpu_axes_separately(mesh_2x4):
  bilevel = _permutes(_cfg(2, 4, 2), mesh_2x4)
  assert {_hop(pairs) for _, pairs in bilevel} == {"node", "gpu"}
  data = sorted(_hop(pairs) for dtype, pairs in bilevel if dtype == "f32")
  # Fig. 5's four exchanges of data, dispatch and combine over 'node' (one ring step with 2 nodes) and over
  # 'gpu' (three ring steps with 4 GPUs), and the combine weights' dispatch over each.
  assert data == ["gpu"] * 9 + ["node"] * 3

  flat = _permutes(MoEConfig(num_experts=16, top_k=1, d_model=8, d_ff=12), mesh_2x4)
  assert "any" in {_hop(pairs) for _, pairs in flat}
  assert sum(dtype == "f32" for dtype, _ in flat) == 3 * 7  # rows, weights and the combine, 7 ring steps each
