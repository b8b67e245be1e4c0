"""The collectives of a compiled program (`moejax.cost.program`): kinds, bytes, mesh axes and run counts read from
XLA's optimised HLO, checked against shapes x dtype sizes and the mesh's own device layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.cost import program
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from tests.helpers import compiled_train_step, random_params

# Checked on jax 0.10 and 0.11 (the GPU machine's 0.11.2); jax 0.12 compiles these programs with another device
# assignment and shard_map semantics, which the parser does not read yet (issue 58).

ROWS, COLS = 16, 32  # each device's block
BOTH = ("node", "gpu")
EXCHANGES = ("all-to-all", "ragged-all-to-all", "collective-permute")


def _compiled(mesh, body, dtype=jnp.float32):
  """body over each device's [ROWS, COLS] block of a [devices x ROWS, COLS] array, compiled."""
  f = jax.shard_map(body, mesh=mesh, in_specs=P(BOTH), out_specs=P(BOTH), check_vma=False)
  return jax.jit(f).lower(jax.ShapeDtypeStruct((mesh.devices.size * ROWS, COLS), dtype)).compile()


def _only(found):
  assert len(found) == 1, found
  return found[0]


def _groups_along(mesh, axes) -> set[frozenset]:
  """The logical device ids (positions in mesh.devices) that differ only along `axes`: one set per group."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  keep = [i for i, name in enumerate(mesh.axis_names) if name not in axes]
  moved = [i for i, name in enumerate(mesh.axis_names) if name in axes]
  rows = np.transpose(ids, keep + moved).reshape(-1, int(np.prod([ids.shape[i] for i in moved])))
  return {frozenset(int(i) for i in row) for row in rows}


BLOCK = ROWS * COLS * 4  # one device's f32 (or s32) block, bytes
# Not bf16: XLA's CPU backend runs a bf16 collective in f32 (converts around it), and the HLO says so.


@pytest.mark.parametrize(
  "name,body,dtype,kind,axes,nbytes",
  [
    ("psum_gpu", lambda a: jax.lax.psum(a, "gpu"), jnp.float32, "all-reduce", ("gpu",), BLOCK),
    ("psum_int_both", lambda a: jax.lax.psum(a, BOTH), jnp.int32, "all-reduce", BOTH, BLOCK),
    ("all_gather_node", lambda a: jax.lax.all_gather(a, "node", tiled=True), jnp.int32, "all-gather", ("node",),
     2 * BLOCK),  # the gathered buffer
    ("all_to_all_both", lambda a: jax.lax.all_to_all(a, BOTH, 0, 0, tiled=True), jnp.float32, "all-to-all", BOTH,
     BLOCK),
    ("psum_scatter_gpu", lambda a: jax.lax.psum_scatter(a, "gpu", tiled=True), jnp.float32, "reduce-scatter", ("gpu",),
     BLOCK),
  ],
)  # fmt: skip
def test_one_known_collective(mesh_2x4, name, body, dtype, kind, axes, nbytes):
  c = _only(program.collectives(_compiled(mesh_2x4, body, dtype), mesh_2x4))
  assert (c.kind, c.axes, c.bytes, c.count, c.in_loop) == (kind, axes, nbytes, 1, False)
  assert c.dtype == {jnp.float32: "f32", jnp.int32: "s32", jnp.bfloat16: "bf16"}[dtype]
  assert {frozenset(g) for g in c.groups} == _groups_along(mesh_2x4, axes)


def test_ppermute_over_node_reports_its_pairs(mesh_2x4):
  swap = functools.partial(jax.lax.ppermute, axis_name="node", perm=[(0, 1), (1, 0)])
  c = _only(program.collectives(_compiled(mesh_2x4, swap), mesh_2x4))
  assert (c.kind, c.axes, c.bytes, c.dtype, c.count) == ("collective-permute", ("node",), BLOCK, "f32", 1)
  ids = np.arange(8).reshape(2, 4)
  assert set(c.groups) == {(int(ids[n, g]), int(ids[1 - n, g])) for n in range(2) for g in range(4)}


def test_ids_map_through_the_mesh_device_array(devices):
  """A mesh whose devices are not in id order (nodes swap devices): a psum over 'gpu' still spans 'gpu' only."""
  order = [0, 5, 2, 7, 4, 1, 6, 3]
  mesh = mesh_lib.make_mesh(2, 4, devices=[devices[i] for i in order])
  c = _only(program.collectives(_compiled(mesh, lambda a: jax.lax.psum(a, "gpu")), mesh))
  assert c.axes == ("gpu",)
  assert program.device_assignment(_compiled(mesh, lambda a: a * 2), mesh) == list(mesh.devices.flat)


def test_stage_axis(devices):
  mesh = mesh_lib.make_mesh(2, 2, stages=2)
  spec = P(("stage", "node", "gpu"))
  f = jax.shard_map(lambda a: jax.lax.ppermute(a, "stage", [(0, 1), (1, 0)]), mesh=mesh, in_specs=spec, out_specs=spec)
  compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((8 * ROWS, COLS), jnp.float32)).compile()
  c = _only(program.collectives(compiled, mesh))
  assert (c.kind, c.axes, c.bytes) == ("collective-permute", ("stage",), BLOCK)


def test_scan_reports_trip_count(mesh_2x4):
  def body(a):
    return jax.lax.scan(lambda carry, _: (jax.lax.psum(carry, "gpu") * 0.5, None), a, None, length=5)[0]

  c = _only(program.collectives(_compiled(mesh_2x4, body), mesh_2x4))
  assert (c.kind, c.axes, c.bytes, c.count, c.in_loop) == ("all-reduce", ("gpu",), BLOCK, 5, True)
  assert program.summary([c]) == {("all-reduce", ("gpu",)): (5, 5 * BLOCK)}


def test_data_dependent_loop_count_unknown(mesh_2x4):
  def body(a):
    return jax.lax.while_loop(lambda v: v.sum() < 1e6, lambda v: jax.lax.psum(v, "gpu") + 1.0, a)

  c = _only(program.collectives(_compiled(mesh_2x4, body), mesh_2x4))
  assert (c.kind, c.count, c.in_loop) == ("all-reduce", None, True)
  assert "?" in str(program.summary([c]))


# Async collectives and iota replica groups, as GPU programs print them: each counted once (its -done and the
# async-done's `calls` not again), the groups read from `[G,S]<=[dims]T(perm)`.
ASYNC_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: bf16[8,4]) -> bf16[8,4] {
  %p = bf16[8,4]{1,0} parameter(0)
  ROOT %a2a = bf16[8,4]{1,0} all-to-all(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
}

ENTRY %main (x: f32[16,32], y: bf16[8,4]) -> f32[16,32] {
  %x = f32[16,32]{1,0} parameter(0)
  %y = bf16[8,4]{1,0} parameter(1)
  %ar-start = f32[16,32]{1,0} all-reduce-start(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %ar-done = f32[16,32]{1,0} all-reduce-done(%ar-start)
  %ag-start = (f32[16,32]{1,0}, f32[64,32]{1,0}) all-gather-start(%x), channel_id=3, replica_groups={}, dimensions={0}
  %ag-done = f32[64,32]{1,0} all-gather-done(%ag-start)
  %start = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}) async-start(%y), calls=%wrapped
  %done = bf16[8,4]{1,0} async-done(%start), calls=%wrapped
  ROOT %r = f32[16,32]{1,0} copy(%ar-done)
}
"""


def test_async_forms_and_iota_groups(mesh_2x4):
  found = {c.kind: c for c in program.parse(ASYNC_HLO, mesh_2x4)}
  assert sorted(found) == ["all-gather", "all-reduce", "all-to-all"]
  assert (found["all-reduce"].axes, found["all-reduce"].bytes, found["all-reduce"].count) == (("gpu",), BLOCK, 1)
  assert found["all-gather"].axes == BOTH and found["all-gather"].bytes == 8 * BLOCK  # groups {}: all 8 devices
  a2a = found["all-to-all"]
  assert (a2a.axes, a2a.bytes, a2a.dtype, a2a.count) == (("node",), 8 * 4 * 2, "bf16", 1)
  assert {frozenset(g) for g in a2a.groups} == _groups_along(mesh_2x4, ("node",))


@pytest.mark.parametrize("axes", [("node",), ("gpu",), BOTH])
def test_groups_by_mesh_axes(mesh_2x4, axes):
  """Replica groups as XLA prints them from jax 0.12 on, by the logical mesh's axes: `mesh['node'=2,'gpu'=4]
  {'gpu'}`."""
  named = ",".join(f"'{a}'" for a in axes)
  hlo = ASYNC_HLO.replace("replica_groups=[4,2]<=[2,4]T(1,0)", f"replica_groups=mesh['node'=2,'gpu'=4] {{{named}}}")
  (a2a,) = [c for c in program.parse(hlo, mesh_2x4) if c.kind == "all-to-all"]
  assert a2a.axes == axes and {frozenset(g) for g in a2a.groups} == _groups_along(mesh_2x4, axes)


def test_summary_adds_runs_and_bytes():
  def make(kind, axes, nbytes, count):
    return program.Collective(kind, "x", nbytes, "f32", axes, (), count, False)

  table = program.summary(
    [make("all-reduce", ("gpu",), 10, 3), make("all-reduce", ("gpu",), 4, 2), make("all-to-all", BOTH, 8, None)]
  )
  assert table == {("all-reduce", ("gpu",)): (5, 38), ("all-to-all", BOTH): (None, None)}
  lines = str(table).splitlines()
  assert lines[0].split() == ["kind", "axes", "runs", "bytes/device"]
  assert lines[1].split() == ["all-reduce", "gpu", "5", "38"] and lines[2].split() == [
    "all-to-all",
    "node,gpu",
    "?",
    "?",
  ]


def test_program_cost_counts_a_matmul(mesh_2x4):
  w = jnp.ones((COLS, 8))
  cost = program.program_cost(_compiled(mesh_2x4, lambda a: a @ w))
  assert cost["flops"] == 2 * ROWS * COLS * 8
  assert cost["bytes accessed"] >= (ROWS * COLS + COLS * 8 + ROWS * 8) * 4


@pytest.mark.slow
def test_scanned_train_step_runs_each_exchange_once_per_layer(devices):
  """A decoder's train step with its layers scanned: every exchange of the layer stack runs once per layer forward
  and once backward, the scan's trip count (the model's layers) times the ring's one step per permute."""
  layers = 3
  compiled, mesh = compiled_train_step(layers)
  exchanges = [c for c in program.collectives(compiled, mesh) if c.kind in EXCHANGES]
  assert exchanges and all(c.in_loop and c.count == layers for c in exchanges)
  assert program.program_cost(compiled)["flops"] > 0


def _ring_pairs(mesh, hop_axes, shift) -> set[tuple[int, int]]:
  """Each device's (source, target) in a ring step `shift` along the hop's axes, flattened in the mesh's order."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  names = list(mesh.axis_names)
  sizes = [ids.shape[names.index(a)] for a in hop_axes]
  pairs = set()
  for coord in np.ndindex(ids.shape):
    peer = np.ravel_multi_index([coord[names.index(a)] for a in hop_axes], sizes)
    moved = dict(zip(hop_axes, np.unravel_index((peer + shift) % int(np.prod(sizes)), sizes)))
    target = tuple(int(moved.get(name, coord[i])) for i, name in enumerate(names))
    pairs.add((int(ids[coord]), int(ids[target])))
  return pairs


@pytest.mark.parametrize("path", ["flat", "node_first"])
@pytest.mark.parametrize("collective", ["padded", "capacity"])
def test_moe_layer_exchanges_follow_its_path(mesh_2x4, path, collective):
  cfg = MoEConfig(
    num_experts=16, top_k=2, d_model=8, d_ff=16, path=path, collective=collective,
    capacity_factor=1.0 if collective == "capacity" else None,
  )  # fmt: skip
  params = random_params(cfg, 0)
  x = jax.ShapeDtypeStruct((8 * 8, cfg.d_model), jnp.float32)
  compiled = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4)).lower(params, x).compile()
  found = program.collectives(compiled, mesh_2x4)
  exchanges = [c for c in found if c.kind in EXCHANGES]
  hops = [tuple(a for a in mesh_2x4.axis_names if a in mesh_lib.hop_axes(h)) for h in path_lib.hops(cfg.path)]
  ring = cfg.collective_kind.ring_of_permutes
  assert {c.kind for c in exchanges} == {"collective-permute" if ring else "all-to-all"}
  assert all(any(set(c.axes) <= set(hop) for hop in hops) for c in exchanges), [(c.name, c.axes) for c in exchanges]
  assert set(hops) <= {c.axes for c in exchanges}
  assert all(c.count is not None for c in found)
  assert any(c.dtype == "f32" and c.bytes % (cfg.d_model * 4) == 0 for c in exchanges)  # the rows themselves
  if len(hops) > 1:  # node_first: no exchange spans both axes
    assert {c.axes for c in exchanges} == set(hops)
  if ring:  # each hop's ring: one permute per shift 1 .. peers - 1, each run once (a switch on the loop's step)
    assert all(c.in_loop and c.in_branch and c.count == 1 for c in exchanges)
    wanted = [frozenset(_ring_pairs(mesh_2x4, hop, s)) for hop in hops for s in range(1, _peers(mesh_2x4, hop))]
    assert {frozenset(c.groups) for c in exchanges} == set(wanted)
  else:
    assert all(not c.in_loop and c.count == 1 for c in exchanges)
    for hop in hops:
      assert any({frozenset(g) for g in c.groups} == _groups_along(mesh_2x4, hop) for c in exchanges)


def _peers(mesh, hop_axes) -> int:
  return int(np.prod([mesh.shape[a] for a in hop_axes]))
