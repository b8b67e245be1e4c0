"""Bounded receive buffers: exact with ample buffers, deterministic counted drops on overflow, and
per-device memory that does not grow with the mesh."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import collective as collective_lib
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import init_params
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from tests import helpers
from tests.helpers import normal

PATHS = ["flat", "gpu_first", "node_first"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.sampled(1)
def test_ample_buffers_equal_reference_with_gradients(devices, path, shape):
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, path=path, buffer_factor=2.0)
  params, x = helpers.random_params(cfg, 3), helpers.normal(4, (128, 8))
  helpers.assert_matches_reference(cfg, mesh_lib.make_mesh(*shape), params, x)  # nothing overflowed, gradients too


def _flat_drops(ids_T, devices, experts_per_gpu, buffer_rows):
  """[T] bool: the top-1 token-choices a flat exchange drops, from the documented rule (per receiver,
  sources in flat order; within a source's block, its earlier tokens first)."""
  tokens_per_device = len(ids_T) // devices
  received = np.zeros(devices, int)
  dropped = np.zeros(len(ids_T), bool)
  for source in range(devices):
    for t in range(source * tokens_per_device, (source + 1) * tokens_per_device):
      dest = ids_T[t] // experts_per_gpu
      dropped[t] = received[dest] >= buffer_rows
      received[dest] += 1
  return dropped


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.sampled(1)
def test_overflow_drops_exactly_and_counts(mesh_2x4, path):
  """Every token to expert 0 with buffer_factor 1: no NaN, each token's output is the reference's or
  exactly zero, zero rows == the drops counted, dropped tokens get zero gradient."""
  cfg = MoEConfig(num_experts=16, top_k=1, d_model=8, d_ff=12, path=path, buffer_factor=1.0)
  tokens = 8 * 16
  params, x = helpers.force_routing(helpers.random_params(cfg, 11), helpers.normal(12, (tokens, 8)), [0])
  y, aux = moe_apply(params, x, cfg, mesh_2x4)
  zero = helpers.zero_or_reference_rows(cfg, params, x, y)
  assert int(aux["tokens_overflowed"]) == zero.sum() == tokens - math.ceil(1.0 * 16 * 1)
  assert int(aux["expert_counts"].sum()) == tokens - zero.sum()
  weights = normal(2, y.shape)
  grad_x = jax.grad(lambda x: jnp.sum(moe_apply(params, x, cfg, mesh_2x4)[0] * weights))(x)
  assert np.all(np.asarray(grad_x)[zero] == 0.0) and np.any(np.asarray(grad_x)[~zero] != 0.0)
  if path == "flat":  # the flat exchange drops exactly what the documented rule says
    ids = np.asarray(jnp.argmax(x @ params["router"]["kernel"], axis=1))
    np.testing.assert_array_equal(zero, _flat_drops(ids, 8, 2, 16))


@pytest.mark.slow
def test_two_hop_overflow_matches_between_paths_when_one_node(devices):
  """On one node the two-hop paths reduce to one intra-node exchange: same drops as the flat one."""
  outputs = []
  for path in PATHS:
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=12, path=path, buffer_factor=1.0)
    params, x = helpers.force_routing(helpers.random_params(cfg, 5), helpers.normal(6, (4 * 24, 8)), [3])
    outputs.append(moe_apply(params, x, cfg, mesh_lib.make_mesh(1, 4)))
  for y, aux in outputs[1:]:
    np.testing.assert_allclose(y, outputs[0][0], rtol=1e-5, atol=1e-6)
    assert int(aux["tokens_overflowed"]) == int(outputs[0][1]["tokens_overflowed"]) > 0


def _bounded_cases():
  """Per concern: the MoEConfig fields of a bounded layer, the smaller mesh (n, m), and whether the same layer
  without the bound grows (the ragged collectives' worst case: the check can fail)."""
  paths = [pytest.param(dict(path=p, buffer_factor=2.0), (1, 2), True, id=p) for p in PATHS]
  # the schedules' chunks from 4 devices: below 4 a chunk's worst case is still under the bound
  chunks = [
    pytest.param(dict(buffer_factor=2.0, schedule=s, num_chunks=2), (1, 4), False, id=f"padded-{s}")
    for s in ("chunked", "comet")
  ]
  # capacity and expert sharding, one node -> two nodes of 4 GPUs, with every schedule
  others = {
    "capacity": dict(collective="capacity", capacity_factor=1.0),
    "capacity-gpu_first": dict(path="gpu_first", collective="capacity", capacity_factor=1.0),
    "s1-bounded": dict(buffer_factor=1.0, esp_schedule="s1"),
    "s2-capacity": dict(collective="capacity", capacity_factor=1.0, esp_schedule="s2"),
  }
  others = [
    pytest.param({**fields, "schedule": s, "num_chunks": 2}, (1, 4), False, id=f"{name}-{s}")
    for s in ("sequential", "chunked", "comet")
    for name, fields in others.items()
  ]
  return paths + chunks + others


@pytest.mark.parametrize("fields,small_mesh,unbounded_grows", _bounded_cases())
@pytest.mark.sampled(1)
def test_temporaries_do_not_grow_with_devices(devices, fields, small_mesh, unbounded_grows):
  """Bounded buffers (or capacity): on 2 x 4 devices the per-device temporaries stay within 1.5x the smaller
  mesh's, for each path, collective, schedule and expert sharding."""
  small, large = helpers.temporary_bytes(*small_mesh, **fields), helpers.temporary_bytes(2, 4, **fields)
  assert large <= 1.5 * small, (small, large)
  if unbounded_grows:
    assert helpers.temporary_bytes(2, 4, **{**fields, "buffer_factor": None}) > 2 * small


@pytest.mark.slow
def test_padded_program_does_not_grow_with_devices(devices):
  """The padded ring's steps are one loop: the layer's forward and backward over 8 peers lower to a program
  within 15% of 2 peers' (a switch branch of one permute per extra peer; unrolled, the ring made it ~2x)."""

  def lines(n, m):
    cfg = MoEConfig(num_experts=2 * n * m, top_k=2, d_model=8, d_ff=8, collective="padded")
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    x = jax.ShapeDtypeStruct((16 * n * m, 8), jnp.float32)
    loss = lambda p, x: moe_apply(p, x, cfg, mesh_lib.make_mesh(n, m))[0].sum()
    return len(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text().splitlines())

  small, large = lines(1, 2), lines(2, 4)
  assert large <= 1.15 * small, (small, large)


@pytest.mark.parametrize("path,hops", [("flat", 1), ("gpu_first", 2), ("node_first", 2)])
@pytest.mark.sampled(1)
def test_cuda_lowering_of_bounded_ragged_exchange(devices, monkeypatch, path, hops):
  """The GPU program (lowered for CUDA here, without a GPU): forward and backward type-check under
  shard_map, every hop is a ragged_all_to_all (ids, rows and weights out, rows back, and the three float moves
  transposed in the backward: 7 per hop; the arrival flags feed only the counts, which the loss leaves out)
  whose receive buffer holds ceil(buffer_factor * T * K) rows."""
  shapes = helpers.cuda_ragged_shapes(monkeypatch, path=path, collective="ragged")
  assert len(shapes) == 7 * hops, shapes
  local_rows, buffer_rows = helpers.LOCAL_TOKENS * 2, math.ceil(1.5 * helpers.LOCAL_TOKENS * 2)
  assert {s for s in shapes} <= {(local_rows, buffer_rows), (buffer_rows, local_rows), (buffer_rows, buffer_rows)}
  assert (local_rows, buffer_rows) in shapes


@pytest.mark.parametrize("nodes,gpus", [(2, 4), (16, 8)])
def test_hop_buffer_sizes_worst_case_and_bounded(nodes, gpus):
  """Worst case: a hop receives all rows of its peers' previous buffers (never more than all rows
  of all devices); bounded: every hop holds ceil(b * local rows), whatever the mesh. With dedup and S slots per
  row a device sends at most min(S, peers) rows per row, and the bound also holds the slots that arrive."""
  axis_sizes, rows = {mesh_lib.NODE: nodes, mesh_lib.GPU: gpus}, 100
  everything = nodes * gpus * rows
  worst = {"flat": [everything], "gpu_first": [gpus * rows, everything], "node_first": [nodes * rows, everything]}
  for path, expected in worst.items():
    hops = path_lib.hops(path)
    assert [h.out_rows for h in path_lib.hop_sizes(hops, axis_sizes, rows, 1, "padded")] == expected
    bound = collective_lib.buffer_bound(1.25, rows)
    assert bound == 125
    sizes = path_lib.hop_sizes(hops, axis_sizes, rows, 1, "padded", bound)
    assert [h.out_rows for h in sizes] == [125] * len(hops) and sizes[-1].bound == 125
  slots = 4  # 25 tokens with 4 slots: as many slots as 100 one-slot rows
  first = path_lib.hop_sizes(((mesh_lib.NODE, mesh_lib.GPU),), axis_sizes, 25, slots, "padded", bound)[0]
  assert first.taken == 25 * min(slots, nodes * gpus) and first.out_rows == 125 and first.bound == 125


@pytest.mark.parametrize("path", PATHS)
def test_capacity_blocks_of_every_hop_hold_what_capacity_kept(path):
  """collective='capacity' on a longer path: hop h sends each peer a block of the flat block times the sources a
  device holds rows of before it (peers of the earlier hops) and the devices after it (peers of the later ones), so
  every hop's buffer holds all n x m flat blocks, as the flat hop's does."""
  n, m, block = 2, 4, 6
  sizes = path_lib.hop_sizes(
    path_lib.hops(path), {mesh_lib.NODE: n, mesh_lib.GPU: m}, 10, 2, collective_lib.Collective("capacity", block)
  )
  peers = {"flat": [n * m], "gpu_first": [m, n], "node_first": [n, m]}[path]
  want_blocks = [block] if path == "flat" else [block * peers[1], block * peers[0]]
  assert [h.collective.block_rows for h in sizes] == want_blocks
  assert [h.out_rows for h in sizes] == [n * m * block] * len(peers)


def test_exchange_memory_table_at_smile_sizes():
  from experiments import exchange_memory

  table = exchange_memory.rows(16, 8, [2.0], ["flat", "node_first"])
  worst = next(r for r in table if r["model"] == "3.7b" and r["path"] == "flat" and r["buffer_factor"] is None)
  assert worst["hop_mib"] == [128 * 16384 * 768 * 2 / 2**20]  # all rows of 128 GPUs: 3 GiB
  bounded = next(r for r in table if r["model"] == "3.7b" and r["path"] == "node_first" and r["buffer_factor"] == 2)
  assert bounded["hop_rows"] == [2 * 16384] * 2
  from configs import exchange_memory as memory_config
  from moejax.validation import ConfigError

  config = memory_config.get_config()
  exchange_memory.check(config)
  config.paths = ("flat", "ragged")
  with pytest.raises(ConfigError, match=r"^config field paths=\('flat', 'ragged'\) is not allowed"):
    exchange_memory.check(config)


@pytest.mark.slow
def test_apply_without_overflow_grows_the_buffers_until_nothing_is_dropped(mesh_2x4):
  import moejax

  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, path="node_first", buffer_factor=0.25)
  # every first choice to expert 0: one device receives 1/8 of all rows
  params, x = helpers.force_routing(helpers.random_params(cfg, 7), helpers.normal(8, (128, 8)), [0])
  _, aux_tight = moe_apply(params, x, cfg, mesh_2x4)
  assert int(aux_tight["tokens_overflowed"]) > 0
  y, aux, grown = moejax.apply_without_overflow(params, x, cfg, mesh_2x4)
  assert int(aux["tokens_overflowed"]) == 0 and grown.buffer_factor in (0.5, 1.0, 2.0, 4.0, 8.0)
  y_ref, _ = moe_reference(params, x, cfg)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  # one doubling less still overflows: the first sufficient factor was returned
  half = dataclasses.replace(cfg, buffer_factor=grown.buffer_factor / 2)
  _, aux_half = moe_apply(params, x, half, mesh_2x4)
  assert int(aux_half["tokens_overflowed"]) > 0
