"""The compute ops of a compiled program (`moejax.cost.program_ops`): categories, FLOPs, bytes and runs of small jitted
programs against their shapes written out here, and `program_price.price_measured`'s compute against the sum of its
ops at given terms (`moejax.study.program_calibration`)."""

import jax
import jax.numpy as jnp
import pytest

from moejax.cost import program_ops, program_price
from moejax.study import compute_calibration, interleaved_timing, program_calibration

F32 = 4


def _ops(fn, *shapes):
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  return program_ops.ops(jax.jit(fn).lower(*args).compile())


def _only(found, category):
  picked = [o for o in found if o.category == category]
  assert len(picked) == 1, found
  return picked[0]


def test_a_matmul_is_one_op_of_2mnk_flops_reading_both_operands_and_writing_its_output():
  m, k, n = 64, 32, 48
  found = _ops(lambda a, b: a @ b, ((m, k), jnp.float32), ((k, n), jnp.float32))
  op = _only(found, "matmul")
  assert (op.flops, op.bytes, op.count) == (2 * m * n * k, (m * k + k * n + m * n) * F32, 1)
  assert all(o.flops == 0 for o in found if o is not op)


def test_a_gather_reads_only_the_rows_it_takes():
  rows, width, picked = 100, 16, 40
  found = _ops(lambda t, i: t.at[i].get(mode="promise_in_bounds"), ((rows, width), jnp.float32), ((picked,), jnp.int32))
  op = _only(found, "gather")
  # the rows read, the indices, the rows written: not the whole table
  assert (op.bytes, op.flops, op.count) == (2 * picked * width * F32 + picked * 4, 0, 1)


SCATTER_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[100,16], p1: s32[40,1], p2: f32[40,1,16]) -> f32[100,16] {
  %p0 = f32[100,16]{1,0} parameter(0)
  %p1 = s32[40,1]{1,0} parameter(1)
  %p2 = f32[40,1,16]{2,1,0} parameter(2)
  ROOT %sc = f32[100,16]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1,2}, inserted_window_dims={}, \
scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (t: f32[100,16], i: s32[40,1], u: f32[40,1,16]) -> f32[100,16] {
  %t = f32[100,16]{1,0} parameter(0)
  %i = s32[40,1]{1,0} parameter(1)
  %u = f32[40,1,16]{2,1,0} parameter(2)
  ROOT %wrapped_scatter = f32[100,16]{1,0} fusion(%t, %i, %u), kind=kLoop, calls=%fused
}
"""


def test_a_scatter_add_updates_its_table_in_place():
  """A scatter fusion (as XLA's CPU backend wraps one): the updates read and written into the table, the indices;
  not the table (updated in place). Its reducer is not an op of its own."""
  picked, width = 40, 16
  found = program_ops.parse(SCATTER_HLO)
  assert [(o.name, o.category, o.count) for o in found] == [("wrapped_scatter", "scatter", 1.0)]
  assert found[0].bytes == 2 * picked * width * F32 + picked * 4


def test_a_compiled_scatter_add_is_found_or_its_loop_counted():
  rows, width, picked = 100, 16, 40
  shapes = ((rows, width), jnp.float32), ((picked,), jnp.int32), ((picked, width), jnp.float32)
  found = _ops(lambda t, i, u: t.at[i].add(u, mode="promise_in_bounds"), *shapes)
  scatters = [o for o in found if o.category == "scatter"]
  if scatters:  # XLA's default pipeline keeps the scatter: as the hand-written one
    assert [(o.bytes, o.count) for o in scatters] == [(2 * picked * width * F32 + picked * 4, 1)]
  else:  # the suite's fast-compile flags expand it into a loop over the picked rows: its body, its condition
    assert {picked, picked + 1} <= {o.count for o in found}
  assert not [o for o in found if o.category == "gather"]


def test_an_argsort_is_a_sort_of_its_keys_and_their_positions():
  keys = 1000
  found = _ops(lambda k: jnp.argsort(k, stable=True), ((keys,), jnp.int32))
  op = _only(found, "sort")
  assert op.bytes == 4 * keys * 4  # two operands (keys, positions) read, both written back


def test_a_loop_body_runs_its_known_trip_count():
  trips = 7
  body = lambda i, x, w: jnp.tanh(x @ w)  # noqa: E731
  found = _ops(
    lambda x, w: jax.lax.fori_loop(0, trips, lambda i, x: body(i, x, w), x),
    ((8, 16), jnp.float32),
    ((16, 16), jnp.float32),
  )
  op = _only(found, "matmul")
  assert (op.flops, op.count) == (2 * 8 * 16 * 16, trips)
  summed = program_ops.summary(found)["matmul"]
  assert summed == (trips, trips * op.flops, trips * op.bytes)
  assert {o.category for o in found} <= set(program_ops.CATEGORIES)


def test_unlisted_instructions_are_skipped():
  hlo = """HloModule m

ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  %b = f32[4]{0} bitcast(%p)
  %n = f32[4]{0} negate(%b)
  %ar = f32[4]{0} all-reduce(%n), replica_groups={}, to_apply=%add
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%n, %ar)
}
"""
  found = program_ops.parse(hlo)
  assert [(o.name, o.category, o.bytes, o.count) for o in found] == [("n", "elementwise", 32, 1.0)]


def test_measured_compute_is_the_sum_of_each_op_at_its_rate(mesh_2x4):
  """A matmul looped 7 times: price_measured's compute is the call, plus per run the matmul's launch and FLOPs at the
  matmul rate, plus the loop's other ops (its step, the tanh, its condition's compare, the copies in) at the
  elementwise rate: each written out here from the shapes."""
  x, w = ((8, 16), jnp.float32), ((16, 16), jnp.float32)
  fn = jax.jit(lambda x, w: jax.lax.fori_loop(0, 7, lambda i, v: jnp.tanh(v @ w), x))
  compiled = fn.lower(*[jax.ShapeDtypeStruct(s, d) for s, d in (x, w)]).compile()
  terms = program_calibration.Terms(
    {}, flops_per_s=2e9, bytes_per_s=5e8, op_bytes_per_s={"gather": 1e8}, launch_s=3e-6, call_s=2e-5
  )
  found = program_ops.ops(compiled)
  matmul = _only(found, "matmul")
  others = [o for o in found if o is not matmul]
  assert {o.category for o in others} == {"elementwise"}
  want = 2e-5 + 7 * (3e-6 + 2 * 8 * 16 * 16 / 2e9) + sum(o.count * (3e-6 + o.bytes / 5e8) for o in others)
  priced = program_price.price_measured(compiled, mesh_2x4, terms)
  assert priced.compute_s == pytest.approx(want, rel=1e-12)
  assert priced.communication_s == 0 and priced.flops == 7 * 2 * 8 * 16 * 16


def test_a_category_rate_is_its_work_over_the_time_the_rest_leaves():
  """category_rate: the call, every op's launch and the other ops at their rates are taken off the time."""
  op = lambda category, nbytes, count: program_ops.Op("x", "fusion", category, 0.0, nbytes, count, "main")  # noqa: E731
  found = [op("elementwise", 1000, 2.0), op("gather", 6000, 3.0)]
  terms = program_calibration.Terms({}, 1e9, bytes_per_s=1e6, launch_s=1e-5, call_s=1e-4)
  seconds = 1e-4 + 2 * (1e-5 + 1000 / 1e6) + 3 * 1e-5 + 3 * 6000 / 2e6
  assert compute_calibration.category_rate("gather", found, seconds, terms) == pytest.approx(2e6, rel=1e-12)
  # a time the rest already fills leaves the category a tenth of it, not nothing
  assert compute_calibration.category_rate("gather", found, 1e-4, terms) == pytest.approx(18000 / 1e-5)


@pytest.mark.slow
def test_compute_terms_are_measured_for_every_category(mesh_2x4):
  programs, found = compute_calibration.compute_programs(mesh_2x4)
  terms = compute_calibration.compute_from(found, interleaved_timing.medians(programs, 1))
  # the scatter's rate where XLA keeps it a scatter (not with the suite's fast-compile flags)
  assert {"gather", "sort"} <= set(terms["op_bytes_per_s"]) <= {"gather", "scatter", "sort"}
  assert terms["flops_per_s"] > 0 and terms["bytes_per_s"] > 0 and min(terms["op_bytes_per_s"].values()) > 0
  assert terms["launch_s"] >= 0 and terms["call_s"] >= 0
  assert program_calibration.Terms({}, **terms).as_dict()["op_bytes_per_s"] == terms["op_bytes_per_s"]
