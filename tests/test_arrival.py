"""The wait at a collective after compute (`moejax.cost.program_segments`, `moejax.study.arrival_calibration`): each
collective's segment is the compute its computation runs since the collective before; the wait interpolates two
calibrated points (float64 arithmetic here); price_measured adds it to each collective after compute and not to one
that follows another; the calibration recovers a wait planted in the timing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.cost import program, program_ops, program_price, program_segments
from moejax.runtime import mesh as mesh_lib
from moejax.study import arrival_calibration, compute_calibration, interleaved_timing, program_calibration

BOTH = ("node", "gpu")


def _terms(compiled, mesh, rng, arrival=()):
  per_kind = {(c.kind, c.axes): (rng.uniform(1e-5, 1e-4), rng.uniform(1e-9, 1e-8)) for c in program.collectives(
    compiled, mesh)}  # fmt: skip
  return program_calibration.Terms(per_kind, 1e9, 1e8, launch_s=2e-6, call_s=5e-5, arrival=arrival)


def test_a_collectives_segment_is_the_compute_since_the_collective_before(mesh_2x4):
  """sort -> psum -> psum -> matmul -> psum: the first psum's segment holds the sort, the second's nothing (it follows
  the first), the third's the matmul, of 2 x 16 x 32 x 32 FLOPs."""

  def body(x, w):
    y = jax.lax.psum(jnp.sort(x, axis=0), BOTH)
    y = jax.lax.psum(y * 3.0, "gpu")
    return jax.lax.psum(jnp.tanh(y @ w[0]), "node")

  f = jax.shard_map(body, mesh=mesh_2x4, in_specs=(P(BOTH), P(BOTH)), out_specs=P(BOTH), check_vma=False)
  compiled = jax.jit(f).lower(jnp.ones((8 * 16, 32)), jnp.ones((8, 32, 32))).compile()
  hlo = compiled.as_text()
  found = program.collectives(compiled, mesh_2x4)
  assert [c.axes for c in found] == [BOTH, ("gpu",), ("node",)]
  segments = program_segments.segments(hlo)
  ops = {o.name: o for o in program_ops.parse(hlo)}
  categories = [[ops[n].category for n in segments[c.name] if n in ops] for c in found]
  assert "sort" in categories[0] and "matmul" not in categories[0]
  assert "matmul" in categories[2] and "sort" not in categories[2]
  assert all(c == "elementwise" for c in categories[1])  # the scale by 3, where XLA keeps it apart
  (matmul,) = [ops[n] for n in segments[found[2].name] if n in ops and ops[n].category == "matmul"]
  assert matmul.flops == 2 * 16 * 32 * 32


def test_a_segment_runs_on_into_branches_and_loops(mesh_2x4):
  """matmul -> cond(psum | nothing) -> sort -> psum -> fori_loop(psum -> scale): the psum first in a branch has the
  matmul before the conditional in its segment (not an empty one: the branch starts with it); the psum after the
  conditional the sort alone (the branch that ran a collective ends the segment, not the one that did not); the
  loop's psum, first in its body, its steady state: the scale after it in the body, not the sort before the loop."""

  def body(x, w, flag):
    y = jnp.tanh(x @ w[0])
    y = jax.lax.cond(flag[0] > 0, lambda v: jax.lax.psum(v, "gpu"), lambda v: v * 2.0, y)
    y = jax.lax.psum(jnp.sort(y, axis=0), "node")
    return jax.lax.fori_loop(0, 3, lambda _, v: jax.lax.psum(v, BOTH) * 0.5, y)

  f = jax.shard_map(body, mesh=mesh_2x4, in_specs=(P(BOTH), P(BOTH), P(BOTH)), out_specs=P(BOTH), check_vma=False)
  compiled = jax.jit(f).lower(jnp.ones((8 * 16, 32)), jnp.ones((8, 32, 32)), jnp.ones((8,), jnp.int32)).compile()
  hlo = compiled.as_text()
  found = program.collectives(compiled, mesh_2x4)
  assert sorted(c.axes for c in found) == sorted([("gpu",), ("node",), BOTH])
  segments = program_segments.segments(hlo)
  ops = {o.name: o for o in program_ops.parse(hlo)}
  categories = {c.axes: {ops[n].category for n in segments[c.name] if n in ops} for c in found}
  assert "matmul" in categories[("gpu",)] and "sort" not in categories[("gpu",)]
  assert "sort" in categories[("node",)] and "matmul" not in categories[("node",)]
  assert categories[BOTH] and not categories[BOTH] & {"sort", "matmul"}


def test_the_wait_interpolates_its_two_points():
  """0 at no compute, w1 x s / s1 up to s1, the line to (s2, w2), w2 beyond; no points: no wait."""
  rng = np.random.default_rng()
  s1, s2 = sorted(rng.uniform(1e-4, 1e-2, 2))
  w1, w2 = rng.uniform(1e-4, 1e-2, 2)
  points = ((s1, w1), (s2, w2))
  at = rng.uniform(0, 1)
  assert program_segments.arrival_seconds(points, at * s1) == pytest.approx(w1 * at, rel=1e-12)
  between = s1 + at * (s2 - s1)
  assert program_segments.arrival_seconds(points, between) == pytest.approx(w1 + at * (w2 - w1), rel=1e-12)
  assert program_segments.arrival_seconds(points, s2 * (1 + at)) == pytest.approx(w2, rel=1e-12)
  assert program_segments.arrival_seconds(points, 0.0) == 0.0
  assert program_segments.arrival_seconds((), s2) == 0.0


@pytest.mark.parametrize("kind", arrival_calibration.WAITED)
def test_the_price_adds_each_collectives_wait_after_its_segment(mesh_2x4, kind):
  """The calibration's rounds program: 8 all-reduces (or permutes), each after one matmul of 2 x side^3 FLOPs; priced
  with the wait, each costs arrival_seconds of its segment's price more (recomputed here from the ops it lists), at
  the points of its kind (a permute's own where measured); a chain of collectives adds a wait to its first only."""
  side = 32
  args = (jnp.ones((8 * side, side)), jnp.ones((8, side, side)))
  compiled = arrival_calibration.rounds_program(mesh_2x4, side, kind=kind).lower(*args).compile()
  hlo = compiled.as_text()
  rng = np.random.default_rng()
  group, peer = (((1e-4, rng.uniform(1e-4, 1e-3)), (1e-2, rng.uniform(1e-3, 1e-2))) for _ in range(2))
  own = {} if kind == "all-reduce" else {kind: peer}
  terms = dataclasses.replace(_terms(compiled, mesh_2x4, rng, group), arrival_by_kind=own)
  points = own.get(kind, group)
  plain = dataclasses.replace(terms, arrival=(), arrival_by_kind={})
  ops = {o.name: o for o in program_ops.parse(hlo)}
  segments = program_segments.segments(hlo)
  found = program.collectives(compiled, mesh_2x4)
  assert len(found) == arrival_calibration.ROUNDS and {c.kind for c in found} == {kind}
  want = 0.0
  for c in found:
    listed = [ops[n] for n in segments[c.name] if n in ops]
    assert [o.flops for o in listed if o.category == "matmul"] == [2 * side**3]
    segment_s = sum(terms.launch_s + (o.flops / 1e9 if o.category == "matmul" else o.bytes / 1e8) for o in listed)
    want += c.count * program_segments.arrival_seconds(points, segment_s)
  with_wait = program_price.price_measured(compiled, mesh_2x4, terms).communication_s
  assert with_wait - program_price.price_measured(compiled, mesh_2x4, plain).communication_s == pytest.approx(
    want, rel=1e-9
  )
  assert want > 0
  chain = jax.shard_map(
    program_calibration._chain("all-reduce", BOTH, mesh_2x4, 4), mesh=mesh_2x4, in_specs=P(BOTH), out_specs=P(BOTH)
  )
  chained = jax.jit(chain).lower(jnp.ones((8 * 16, 8))).compile()
  chain_terms = _terms(chained, mesh_2x4, rng, points)
  before = [program_price.segment_seconds(chained.as_text(), program_ops.ops(chained), chain_terms)[c.name] for c in
           program.collectives(chained, mesh_2x4)]  # fmt: skip
  assert before[1:] == [0.0, 0.0, 0.0]


def test_the_calibration_recovers_a_planted_wait(mesh_2x4):
  """wait_from at the program's price without the wait plus ROUNDS x a planted wait gives back the planted wait and
  the mean segment's price; a time below the price gives 0, never a negative wait."""
  side = 32
  rng = np.random.default_rng()
  compiled, _ = arrival_calibration.wait_program(side, mesh_2x4)
  terms = _terms(compiled, mesh_2x4, rng)
  price = program_price.price_measured(compiled, mesh_2x4, terms).serial_s
  segments = program_price.segment_seconds(compiled.as_text(), program_ops.ops(compiled), terms)
  planted = rng.uniform(1e-4, 1e-2)
  segment_s, wait = arrival_calibration.wait_from(
    compiled, mesh_2x4, terms, price + arrival_calibration.ROUNDS * planted
  )
  assert wait == pytest.approx(planted, rel=1e-9)
  assert segment_s == pytest.approx(np.mean(list(segments.values())), rel=1e-9)
  assert arrival_calibration.wait_from(compiled, mesh_2x4, terms, price / 2)[1] == 0.0


@pytest.mark.parametrize("width", arrival_calibration.OPERAND_FLOATS)
def test_the_calibration_recovers_a_planted_cost_per_operand(mesh_2x4, width):
  """per_operand_from on the many-operand program (operands of `width` floats) timed at its price without a cost per
  operand, plus ROUNDS x (the one-array program's wait + (OPERANDS - 1) x a planted cost) gives back the cost, whatever
  the terms held for it before (`Terms.per_operand`'s and `Terms.tiny`'s); the program priced with it in the term its
  size reads (tiny's at TINY bytes) and the wait is that time again; a time at its price gives 0, never a negative
  cost."""
  compiled, _ = arrival_calibration.wait_program(
    arrival_calibration.SIDES[-1], mesh_2x4, arrival_calibration.OPERANDS, width
  )
  rng = np.random.default_rng()
  key = arrival_calibration.sync_key(mesh_2x4)
  assert key == ("all-reduce", BOTH)
  tiny_alpha = rng.uniform(1e-5, 1e-4)
  terms = dataclasses.replace(
    _terms(compiled, mesh_2x4, rng), per_operand={key: rng.uniform(1e-4, 1e-3)}, tiny={key: (tiny_alpha, 1e-3)}
  )
  bare = dataclasses.replace(terms, per_operand={}, tiny={key: (tiny_alpha, 0.0)})
  price = program_price.price_measured(compiled, mesh_2x4, bare).serial_s
  planted, wait = rng.uniform(1e-4, 1e-2, 2)
  seconds = price + arrival_calibration.ROUNDS * (wait + (arrival_calibration.OPERANDS - 1) * planted)
  each = arrival_calibration.per_operand_from(compiled, mesh_2x4, terms, seconds, wait)
  assert each == pytest.approx(planted, rel=1e-9)
  read = (
    dict(tiny={key: (tiny_alpha, each)}) if 4 * width == program_calibration.TINY else dict(per_operand={key: each})
  )
  priced = program_price.price_measured(compiled, mesh_2x4, dataclasses.replace(bare, **read))
  assert priced.serial_s + arrival_calibration.ROUNDS * wait == pytest.approx(seconds, rel=1e-9)
  assert arrival_calibration.per_operand_from(compiled, mesh_2x4, terms, price, wait) == 0.0


def test_retimed_terms_come_from_every_round_so_far(devices, monkeypatch):
  """MeshCalibration.retime twice: the second terms are those of each compute, wait and many-operand program's median
  (a program holding a lone collective: its lower quartile; Terms.skew: a lone small collective's median less its quartile) over both calls'
  rounds (a planted clock: the first call's rounds fast, the second's slow), not of the second call alone; only the
  first warms the programs."""
  mesh = mesh_lib.make_mesh(1, 2, devices=devices[:2])
  calibration = arrival_calibration.MeshCalibration(mesh)
  rng = np.random.default_rng()
  base = rng.uniform(1e-4, 1e-3, len(calibration.programs))
  n, c, w = len(calibration.keys), len(calibration.found), len(calibration.waits)
  base[n + c : n + c + w] = rng.uniform(0.05, 0.5, w)  # the wait programs': waits well above 0, each its own
  base[-2:] = rng.uniform(0.5, 1.0, 2)  # the many-operand programs': a cost per operand well above 0
  fast, slow = [list(b * rng.uniform(1, 1.2, 3)) for b in base], [list(b * rng.uniform(3, 4, 2)) for b in base]
  clock, warmed = iter([fast, slow]), []
  monkeypatch.setattr(interleaved_timing, "samples", lambda programs, repeats, warm: warmed.append(warm) or next(clock))
  quiet = lambda *a: None  # noqa: E731
  first = calibration.retime(3, quiet)
  second = calibration.retime(2, quiet)
  assert calibration.rounds == 5 and first != second
  assert warmed == [True, False]  # only the first rounds call each program untimed first
  median = [float(np.median(a + b)) for a, b in zip(fast, slow)]  # 3 fast, 2 slow: the third fast one
  quartile = [float(np.quantile(a + b, arrival_calibration.COLLECTIVE_QUANTILE)) for a, b in zip(fast, slow)]
  both = [m if i >= n else q for i, (m, q) in enumerate(zip(median, quartile))]  # lone collectives at the quartile
  small = (program_calibration.SIZES[0], 1, 1)
  skew = {k[:2]: median[i] - quartile[i] for i, k in enumerate(calibration.keys) if k[2:] == small}
  assert skew and all(s > 0 for s in skew.values())  # 3 fast rounds, 2 slow: the median above the quartile
  compute = compute_calibration.compute_from(calibration.found, both[n : n + c])
  want = program_calibration.terms_from(dict(zip(calibration.keys, both[:n])), compute, mesh, say=quiet)
  want = dataclasses.replace(want, skew=skew)
  waits = tuple(
    arrival_calibration.wait_from(compiled, mesh, want, s) for (compiled, _), s in zip(calibration.waits, both[n + c :])
  )
  sides = len(arrival_calibration.SIDES)
  waited = arrival_calibration.WAITED
  assert len(waits) == len(waited) * sides and len(both) == n + c + len(waits) + 2  # an all-reduce's, then the others'
  key = arrival_calibration.sync_key(mesh)
  tiny, small = (
    arrival_calibration.per_operand_from(compiled, mesh, want, s, waits[sides - 1][1])
    for (compiled, _), s in zip(calibration.many, both[-2:])
  )
  assert tiny > 0 and small > 0
  assert dataclasses.replace(second, arrival=(), arrival_by_kind={}) == dataclasses.replace(
    want,
    per_operand={**want.per_operand, key: pytest.approx(small, rel=1e-12)},
    tiny={**want.tiny, key: (want.tiny[key][0], pytest.approx(tiny, rel=1e-12))},
  )
  np.testing.assert_allclose(second.arrival, waits[:sides], rtol=1e-12)  # sums of the segments' ops, in any order
  assert list(second.arrival_by_kind) == list(waited[1:])
  for i, kind in enumerate(waited[1:], 1):
    np.testing.assert_allclose(second.arrival_by_kind[kind], waits[i * sides : (i + 1) * sides], rtol=1e-12)
    assert second.arrival_points(kind) == second.arrival_by_kind[kind] != second.arrival
  assert all(w > 0 for _, w in waits) and second.arrival_points("all-gather") == second.arrival
  assert second.per_kind[("all-to-all", ("gpu",))] != first.per_kind[("all-to-all", ("gpu",))]


def test_one_device_has_no_wait_to_measure(devices):
  """On a 1 x 1 mesh the calibration measures no wait (no collective spans devices) instead of dividing by none."""
  mesh = mesh_lib.make_mesh(1, 1, devices=devices[:1])
  terms = arrival_calibration.measure(mesh, repeats=1, say=lambda *a: None)
  assert (terms.per_kind, terms.arrival) == ({}, ())
