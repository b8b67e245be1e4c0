"""Per-phase timing from the layer's own program: the profile's self times against a hand sum on nested events,
each instruction's phase, and every path's and collective's phases classified as the cost model classifies them,
adding up to the layer."""

import math
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from moejax.cost import program as program_lib
from moejax.moe import experts
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime.mesh import AXES
from moejax.study import phase_timing, profiled_phases
from tests.helpers import normal, random_params


def event(name, start, duration):
  return types.SimpleNamespace(name=name, start_ns=start, duration_ns=duration)


def test_self_time_goes_to_the_nearest_instruction():
  """A while loop holding a dot and a collective (whose rendezvous wait is its own), the executor's own time, and
  events outside the program: each phase's seconds by hand."""
  phases = {"while.1": "other", "dot.2": "expert", "all-to-all.3": "inter_node", "fusion.4": "other"}
  thread = [
    event(profiled_phases.EXECUTOR, 0, 1000),
    event("while.1", 100, 700),
    event("dot.2", 150, 200),
    event("all-to-all.3", 400, 300),
    event("Rendezvous", 450, 200),
    event("fusion.4", 850, 100),
  ]
  other_thread = [event("dot.2", 5, 50), event("Wait: pending_threads=1/8", 100, 900), event("python", 0, 10_000)]
  got = profiled_phases.self_times([thread, other_thread], phases)
  # executor 1000 - while 700 - fusion 100 = 200 own; while 700 - dot 200 - all-to-all 300 = 200; fusion 100
  want = {"other": (200 + 200 + 100) * 1e-9, "expert": (200 + 50) * 1e-9, "inter_node": 300e-9, "intra_node": 0.0}
  assert got == pytest.approx(want)


def test_covered_seconds_is_the_union_of_the_covering_events():
  """Overlapping and nested events count once, gaps not at all; the window spans the program's events."""
  device_a = [event("dot", 100, 300), event("psum", 400, 500), event("fusion", 950, 50)]
  device_b = [event("fusion", 200, 400), event("dot", 250, 100), event("psum", 600, 500)]  # nested in the fusion's span
  covered, window = profiled_phases.covered_seconds([device_a, device_b], {"dot", "fusion"}, {"dot", "fusion", "psum"})
  # compute [100, 600) and [950, 1000): 550 ns; the program's events [100, 1100)
  assert (covered, window) == pytest.approx((550e-9, 1000e-9))
  assert profiled_phases.covered_seconds([], {"dot"}, {"dot"}) == (0.0, 0.0)


def test_each_instruction_has_its_phase(mesh_2x4):
  """An exchange over 'node' is inter-node, over 'gpu' intra-node; a dot in the experts' scope is 'expert', one
  outside it 'other'."""

  def body(x, w):
    y = jax.lax.all_to_all(x.reshape(2, -1, x.shape[-1]), mesh_lib.NODE, 0, 0)
    y = jax.lax.all_to_all(y.reshape(4, -1, x.shape[-1]), mesh_lib.GPU, 0, 0).reshape(x.shape)
    with jax.named_scope(experts.SCOPE):
      h = jnp.tanh(y @ w)
    return h @ w.T

  f = jax.jit(jax.shard_map(body, mesh=mesh_2x4, in_specs=(P(AXES), P()), out_specs=P(AXES), check_vma=False))
  x, w = jnp.ones((8 * 8, 16)), jnp.ones((16, 32))
  compiled = f.lower(x, w).compile()
  phases = profiled_phases.phase_of(compiled, mesh_2x4)
  text = compiled.as_text()
  exchanges = sorted((name, phase) for name, phase in phases.items() if name.startswith("all-to-all"))
  assert [phase for _, phase in exchanges] and {p for _, p in exchanges} == {"inter_node", "intra_node"}
  scoped = [name for name, phase in phases.items() if phase == "expert"]
  assert scoped and all(experts.SCOPE in line for line in text.splitlines() for name in scoped if f" {name} = " in line)
  shares = profiled_phases.shares(compiled, (x, w), mesh_2x4)
  assert sum(shares.values()) == pytest.approx(1.0) and min(shares.values()) >= 0
  assert shares["inter_node"] > 0 and shares["intra_node"] > 0 and shares["expert"] > 0


def test_each_collective_has_an_event_per_device_and_run(mesh_2x4):
  """A program's collectives read from its profile: an all-to-all once and a psum in a loop of 3 each hold one event
  per device, run of the program and run of the instruction, none of them empty."""

  def body(x):
    y = jax.lax.all_to_all(x.reshape(8, -1, x.shape[-1]), AXES, 0, 0, tiled=True).reshape(x.shape)
    return jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(jax.lax.psum(v, mesh_lib.GPU)), y)

  f = jax.jit(jax.shard_map(body, mesh=mesh_2x4, in_specs=P(AXES), out_specs=P(AXES), check_vma=False))
  x = normal(0, (8 * 16, 32))
  compiled = f.lower(x).compile()
  jax.block_until_ready(compiled(x))
  found = {c.name: c for c in program_lib.collectives(compiled, mesh_2x4)}
  assert sorted((c.kind, c.count) for c in found.values()) == [("all-reduce", 3), ("all-to-all", 1)]
  seconds = profiled_phases.collective_seconds(compiled, (x,), mesh_2x4, runs=2)
  assert set(seconds) == set(found)
  for name, events in seconds.items():
    assert len(events) == 2 * 8 * found[name].count and min(events) > 0, name


@pytest.mark.parametrize(
  "n,m,path,collective,cf",
  [
    (2, 4, "flat", "padded", None),
    (2, 4, "gpu_first", "padded", None),
    (2, 4, "node_first", "padded", 2.0),
    (2, 4, "flat", "capacity", 1.0),
    (2, 4, "gpu_first", "capacity", 1.0),
    (1, 4, "flat", "padded", None),
  ],
)
@pytest.mark.sampled(2)
def test_phases_are_split_by_the_links_they_cross(devices, n, m, path, collective, cf):
  mesh = mesh_lib.make_mesh(n, m)
  cfg = MoEConfig(
    num_experts=2 * n * m,
    top_k=2,
    d_model=16,
    d_ff=32,
    path=path,
    collective=collective,
    capacity_factor=cf,
    routing="bilevel" if path == "node_first" else "topk",
    num_nodes=n,
  )
  params = random_params(cfg, 0)
  x = normal(1, (n * m * 16, cfg.d_model))
  got = phase_timing.measure_phases(params, x, cfg, mesh, warmup=1, repeats=2)
  assert got["layer_ms"] >= got["layer_ms_min"] > 0 and got["layer_expert_ms"] > 0
  total = got["layer_inter_node_ms"] + got["layer_intra_node_ms"] + got["layer_expert_ms"] + got["layer_other_ms"]
  assert total == pytest.approx(got["layer_ms"])
  assert min(got.values()) >= 0
  # One node: nothing crosses nodes. Flat exchanges on two nodes cross them (one exchange over
  # both axes); the two-hop paths also have a hop over 'gpu' only.
  assert (got["layer_inter_node_ms"] > 0) == (n > 1)
  assert (got["layer_intra_node_ms"] > 0) == (n == 1 or path != "flat")


def test_a_failed_profile_leaves_the_layer_time_and_nan_phases(mesh_2x4, monkeypatch):
  def no_profiler(*_):
    raise RuntimeError("no CUPTI")

  monkeypatch.setattr(profiled_phases, "shares", no_profiler)
  cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, num_nodes=2)
  params = random_params(cfg, 0)
  x = normal(1, (8 * 16, cfg.d_model))
  got = phase_timing.measure_phases(params, x, cfg, mesh_2x4, warmup=0, repeats=1)
  assert got["layer_ms"] > 0 and all(math.isnan(got[f"layer_{p}_ms"]) for p in profiled_phases.PHASES)
