"""Collectives and paths on a simulated 2x4 mesh: `padded` against the NumPy ragged model, every path's hops
delivering every row to the device of its expert and back, and the one-device exchange."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.moe import collective as collective_lib
from moejax.moe import path as path_lib
from moejax.moe import plan as plan_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from tests import ragged_sim
from tests.helpers import random_params

ALL = mesh_lib.AXES


def test_padded_all_to_all_matches_ragged_semantics(mesh_2x4):
  rng = np.random.default_rng(0)
  num, rows, out_rows, width = 8, 16, 40, 3
  sizes = rng.integers(0, 3, (num, num))
  sizes[:, 5] = 0  # a device that receives nothing
  sizes[2] = [0, 0, 0, 0, 0, 0, 0, 6]  # a device that sends everything to one peer
  args = [plan_lib.ragged_args(jnp.asarray(sizes), me) for me in range(num)]
  # Senders skip a random first row; receivers leave gaps between blocks: general ragged offsets.
  shift_in = rng.integers(0, 2, num)
  fwd = [
    plan_lib.RaggedArgs(a.input_offsets + shift_in[me], a.send_sizes, a.output_offsets * 2, a.recv_sizes)
    for me, (a, _) in enumerate(args)
  ]
  operands = rng.normal(size=(num, rows + 1, width)).astype(np.float32)
  outputs = np.full((num, out_rows, width), 7.0, np.float32)  # rows not received must keep this value
  expected = ragged_sim.ragged_all_to_all(list(operands), list(outputs), fwd)

  stacked = [np.stack([np.asarray(getattr(a, f)) for a in fwd]).reshape(-1) for f in plan_lib.RaggedArgs._fields]

  def body(operand, output, *arg_arrays):
    return collective_lib.padded_all_to_all(operand[0], output[0], *arg_arrays, axis_name=ALL)[None]

  spec = P(ALL)
  got = jax.jit(jax.shard_map(body, mesh=mesh_2x4, in_specs=(spec,) * 6, out_specs=spec))(operands, outputs, *stacked)
  np.testing.assert_array_equal(np.asarray(got), np.stack(expected))


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize(
  "n,m,hops",
  [
    (2, 4, path_lib.hops("flat")),
    (2, 4, path_lib.hops("gpu_first")),
    (4, 2, path_lib.hops("gpu_first")),
    (2, 4, path_lib.hops("node_first")),
    (1, 8, path_lib.hops("gpu_first")),
    (8, 1, path_lib.hops("gpu_first")),
  ],
)
@pytest.mark.sampled(1)
def test_dispatch_delivers_to_expert_owner_and_combine_returns(n, m, hops, dedup):
  """Rows with 3 slots each: every slot reaches its expert's device, in one row per (row, device) with dedup
  (carrying all its slots there) or one row per slot without; the way back sums a row's returns (here each
  received row sends back its payload times its slot count, so a row gets its payload times its slots);
  `path.arrived` reports every slot."""
  mesh = mesh_lib.make_mesh(n, m)
  num, rows, slots, experts_per_gpu = n * m, 10, 3, 2
  rng = np.random.default_rng(n * 10 + m)
  ids = rng.integers(-1, num * experts_per_gpu, (num, rows, slots)).astype(np.int32)  # -1: not sent
  ids[1] = 3  # one device sends everything to one expert
  ids[2, :, 1] = ids[2, :, 0] ^ 1  # a row's two slots on one device
  values = rng.normal(size=(num, rows, 4)).astype(np.float32)
  sizes = {mesh_lib.NODE: n, mesh_lib.GPU: m}

  def body(x, e):
    ids_r, path = path_lib.plan_path(e[0], hops, sizes, experts_per_gpu, "padded", dedup=dedup)
    rows_r = path_lib.move_through(x[0], path)
    count_R = jnp.sum(ids_r >= 0, axis=1, keepdims=True).astype(jnp.float32)
    back = path_lib.move_back(rows_r * count_R, path)
    arrived = path_lib.arrived(ids_r, path)
    return rows_r[None], ids_r[None], back[None], arrived[None]

  spec = P(ALL)
  rows_r, ids_r, back, arrived = map(
    np.asarray, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 4))(values, ids)
  )
  for device in range(num):
    here = ids_r[device] >= 0
    assert np.all(ids_r[device][here] // experts_per_gpu == device)
    used = here.any(axis=1)
    assert not rows_r[device][~used].any()
    got = sorted((tuple(v), tuple(sorted(i[i >= 0]))) for v, i in zip(rows_r[device][used], ids_r[device][used]))
    want = []
    for src in range(num):
      for r in range(rows):
        mine = [int(i) for i in ids[src, r] if i >= 0 and i // experts_per_gpu == device]
        groups = [mine] if dedup and mine else [[i] for i in mine]
        want += [(tuple(values[src, r]), tuple(sorted(g))) for g in groups]
    assert got == sorted(want)
  np.testing.assert_allclose(back, values * (ids >= 0).sum(axis=2, keepdims=True), rtol=1e-6)
  np.testing.assert_array_equal(arrived, ids >= 0)


@pytest.mark.parametrize("out_rows", [5, 12, 20])
def test_exchange_along_a_one_device_axis_matches_ragged_semantics(devices, out_rows):
  """An axis of one device ('node' of a 1x8 mesh): my rows to myself, read from and written at offset 0,
  the rest of the buffer left at the fill; receive buffers shorter, equal and longer than the operand."""
  rng = np.random.default_rng(out_rows)
  num, rows = 8, 12
  sends = rng.integers(0, min(rows, out_rows) + 1, num)
  sends[0] = min(rows, out_rows)  # a device whose buffer is full
  operands = rng.normal(size=(num, rows, 3)).astype(np.float32)
  fill = np.full((1, out_rows, 3), -7.0, np.float32)
  args = [plan_lib.ragged_args(jnp.asarray([[s]]), 0)[0] for s in sends]
  expected = [ragged_sim.ragged_all_to_all([operands[i]], list(fill), [args[i]])[0] for i in range(num)]

  def body(operand, send):
    one = plan_lib.ragged_args(send.reshape(1, 1), 0)[0]
    return collective_lib.exchange(operand[0], one, out_rows, mesh_lib.NODE, "padded", fill=-7.0)[None]

  got = jax.jit(jax.shard_map(body, mesh=mesh_lib.make_mesh(1, 8), in_specs=(P(ALL), P(ALL)), out_specs=P(ALL)))(
    operands, jnp.asarray(sends, jnp.int32)
  )
  np.testing.assert_array_equal(np.asarray(got), np.stack(expected))


@pytest.mark.parametrize("schedule", ["sequential", "comet"])
def test_one_device_layer_moves_rows_without_scatters(devices, schedule):
  """On a 1x1 mesh the layer's forward+backward moves token rows by gathers alone: the one-peer exchange
  keeps rows in place and every row permutation's backward gathers by its inverse (`plan.permute_rows`);
  a scatter of rows [R, d] (or [R, d + 1], the width of a combine that carries the arrival column) would be a
  pass more, into zeros."""
  cfg = MoEConfig(num_experts=4, top_k=2, d_model=48, d_ff=16, collective="padded", gated=True, schedule=schedule)
  params = random_params(cfg, 0)
  mesh = mesh_lib.make_mesh(1, 1)

  def loss(params, x):
    y, aux = moe_apply(params, x, cfg, mesh)
    return jnp.sum(y * y) + aux["aux_loss"]

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, jnp.ones((32, 48))).as_text(dialect="hlo")
  row_ops = lambda op: re.findall(rf"= f32\[\d+,4[89]\]\S* {op}\(", hlo)
  assert len(row_ops("gather")) >= 4 and row_ops("scatter") == []
