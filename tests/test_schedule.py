"""Schedules (sequential, chunked, comet) give the reference's result, drop what sequential drops,
and leave XLA the independence that lets exchanges overlap expert compute."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError
from tests import helpers
from tests.helpers import normal, random_params
from tests.hlo_graph import contains, entry_graph, float_exchanges

# (mesh, routing, path, schedule, num_chunks, backend, buffer_factor, top_k, experts per device)
CASES = [
  ((2, 4), "topk", "flat", "comet", 2, "ragged_dot", None, 2, 2),
  ((2, 4), "topk", "gpu_first", "comet", 4, "dense", 2.0, 2, 1),
  ((2, 4), "bilevel", "node_first", "comet", 2, "ragged_dot", None, 2, 2),
  ((4, 2), "node_limited", "flat", "chunked", 2, "ragged_dot", 2.0, 2, 2),
  ((2, 4), "bilevel", "node_first", "chunked", 4, "dense", None, 1, 2),
  ((1, 2), "topk", "gpu_first", "comet", 2, "pallas", None, 2, 2),
  ((1, 1), "topk", "flat", "chunked", 2, "ragged_dot", None, 2, 4),
]


@pytest.mark.parametrize(
  "shape,routing,path,schedule,chunks,backend,bf,k,experts_per_gpu",
  CASES,
  ids=[f"{c[0][0]}x{c[0][1]}-{c[1]}-{c[2]}-{c[3]}{c[4]}-{c[5]}-bf{c[6]}" for c in CASES],
)
@pytest.mark.sampled(1)
def test_schedule_matches_reference(devices, shape, routing, path, schedule, chunks, backend, bf, k, experts_per_gpu):
  n, m = shape
  cfg = MoEConfig(
    num_experts=n * m * experts_per_gpu,
    top_k=k,
    d_model=8,
    d_ff=12,
    routing=routing,
    path=path,
    expert_backend=backend,
    num_nodes=n if routing != "topk" else None,
    node_top_k=1 + (n > 2),
    buffer_factor=bf,
    schedule=schedule,
    num_chunks=chunks,
    gated=k == 2,
    renormalize=routing == "topk",
    z_loss_coef=1e-3,
  )
  seed = 31 * n + 7 * m + chunks
  params = random_params(cfg, seed)
  x = normal(seed + 1, (n * m * 8, 8))
  _, aux = helpers.assert_matches_reference(cfg, mesh_lib.make_mesh(n, m), params, x)
  assert int(aux["tokens_overflowed"]) == 0


@pytest.mark.parametrize("schedule,path", [("comet", "flat"), ("chunked", "gpu_first")])
@pytest.mark.slow
def test_overflow_drops_what_sequential_drops(mesh_2x4, schedule, path):
  """Every first choice to expert 0 with a tight buffer: output, drop count, expert counts and
  gradients equal the sequential schedule's, and something was dropped."""
  base = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, path=path, buffer_factor=0.75)
  params, x = helpers.force_routing(helpers.random_params(base, 17), helpers.normal(18, (8 * 16, 8)), [0])
  weights = helpers.normal(19, x.shape)

  def run(cfg):
    def loss(p, x):
      y, aux = moe_apply(p, x, cfg, mesh_2x4)
      return jnp.sum(y * weights), (y, aux)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, aux, grads

  y_seq, aux_seq, grads_seq = run(base)
  y, aux, grads = run(dataclasses.replace(base, schedule=schedule, num_chunks=4 if schedule == "comet" else 2))
  assert int(aux_seq["tokens_overflowed"]) > 0
  assert int(aux["tokens_overflowed"]) == int(aux_seq["tokens_overflowed"])
  np.testing.assert_array_equal(aux["expert_counts"], aux_seq["expert_counts"])
  np.testing.assert_allclose(y, y_seq, rtol=1e-5, atol=1e-6)
  for g, g_seq in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_seq)):
    np.testing.assert_allclose(g, g_seq, rtol=1e-4, atol=1e-6)


def test_bad_schedules_are_named(mesh_2x4):
  with pytest.raises(ConfigError, match="schedule='pipelined'"):
    MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, schedule="pipelined")
  with pytest.raises(ConfigError, match="num_chunks=3.*divisor of d_model=8"):
    MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, schedule="comet", num_chunks=3)
  with pytest.raises(ConfigError, match="num_chunks=0"):
    MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, schedule="chunked", num_chunks=0)
  for dedup, rows in ((False, "16 token-choice rows"), (True, r"8 token rows \(dedup: one row per token\)")):
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, schedule="chunked", num_chunks=3, dedup=dedup)
    params = random_params(cfg, 0)
    with pytest.raises(ConfigError, match=f"num_chunks=3 does not divide the {rows} each device sends"):
      moe_apply(params, jnp.ones((64, 8)), cfg, mesh_2x4)


def _dependent_matmuls(cfg, mesh):
  """{(payload columns, matmuls it depends on): [matmuls depending on it, for each float exchange]}, matmul count.
  A dispatch depends on the router's matmul alone, a combine on the expert GEMMs too."""
  params = random_params(cfg, 0)
  x = normal(1, (mesh.size * 8, cfg.d_model))
  hlo = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile().as_text()
  nodes, ancestors, bodies = entry_graph(hlo)
  matmuls = [
    n for n, (op, _, _, called) in nodes.items() if op == "dot" or any(contains(bodies, c, "dot") for c in called)
  ]
  dependents = {}
  for name, columns in float_exchanges(nodes, bodies).items():
    upstream = sum(mm in ancestors[name] for mm in matmuls)
    dependents.setdefault((columns, upstream), []).append(sum(name in ancestors[mm] for mm in matmuls))
  return dependents, len(matmuls)


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("schedule", ["sequential", "chunked", "comet"])
@pytest.mark.sampled(1)
def test_compiled_program_leaves_exchanges_independent_of_other_matmuls(mesh_2x4, schedule, dedup):
  """Flat exchanges over 8 peers, C = 2, no gating: one router matmul, one first and one second expert GEMM
  per computed piece. sequential: the dispatch feeds both GEMMs; chunked: a chunk's dispatch feeds only its own
  two GEMMs; comet: the others' rows (the device's own move locally) feed the first GEMM of those rows and the C
  second-GEMM blocks, not the GEMM of the device's own rows. The weights (S columns: K slots with dedup, 1
  without) follow the router and feed no matmul (the experts scale their outputs); the combines feed no matmul
  and carry d columns (lossless buffers), or d / C per comet block."""
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, schedule=schedule, num_chunks=2, dedup=dedup)
  dependents, matmuls = _dependent_matmuls(cfg, mesh_2x4)
  d, c, w = 8, 2, 2 if dedup else 1
  if schedule == "sequential":  # dispatch and weights: after the router; combine: after the router and both GEMMs
    assert matmuls == 3 and dependents == {(d, 1): [2], (w, 1): [0], (d, 3): [0]}
  elif schedule == "chunked":  # per chunk: the dispatch feeds its 2 GEMMs
    assert matmuls == 5 and dependents == {(d, 1): [2] * c, (w, 1): [0] * c, (d, 3): [0] * c}
  else:  # a column block's combine: after the router, both first GEMMs and its own second-GEMM block
    assert matmuls == 1 + 2 + c
    assert dependents == {(d, 1): [1 + c], (w, 1): [0], (d // c, 4): [0] * c}


def test_bounded_buffers_learn_arrival_from_int_flags(mesh_2x4):
  """Where a hop may drop rows, which slots arrived comes back as int32 flags before any row moves (so a
  choice's copies can be zeroed together): the float exchanges are those of lossless buffers, the combine d wide."""
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, buffer_factor=1.5)
  dependents, matmuls = _dependent_matmuls(cfg, mesh_2x4)
  assert matmuls == 3 and dependents == {(8, 1): [2], (2, 1): [0], (8, 3): [0]}


@pytest.mark.parametrize("schedule", ["chunked", "comet"])
@pytest.mark.sampled(1)
def test_cuda_lowering_of_the_schedules(devices, monkeypatch, schedule):
  """The GPU program (lowered for CUDA, without a GPU) with bounded buffers over 8 peers, C = 2, dedup.
  comet: the ids move once, the others' rows in one exchange (own rows locally), the weights in one, and the
  rows back as C column blocks; the three float moves transposed in the backward: 3 + C + 2 + C ragged
  all-to-alls into the bounded buffer. chunked: the ids' round trip that decides the drops, then per chunk the
  sequential seven (ids, rows, weights, rows back, and the three float moves transposed)."""
  shapes = helpers.cuda_ragged_shapes(monkeypatch, collective="ragged", schedule=schedule, num_chunks=2)
  local_rows, buffer_rows = helpers.LOCAL_TOKENS * 2, math.ceil(1.5 * helpers.LOCAL_TOKENS * 2)
  if schedule == "comet":
    assert len(shapes) == 3 + 2 + 2 + 2, shapes
    assert set(shapes) == {(local_rows, buffer_rows), (buffer_rows, local_rows)}, shapes
  else:
    assert len(shapes) == 2 + 2 * 7, shapes
    # every chunk receives into the whole bound: one chunk may hold all the rows that fit
    assert set(shapes) == {
      (local_rows, buffer_rows),
      (buffer_rows, local_rows),
      (local_rows // 2, buffer_rows),
      (buffer_rows, local_rows // 2),
    }, shapes
