"""Each compute op of a program as a module of its own (`moejax.cost.op_modules`), timed alone on every device of the
mesh (`moejax.study.op_timing`): a module computes what its op computes (float64 NumPy on random inputs), ops that
differ only in XLA's numbering share a module, a module XLA refuses is reported and not timed, and
`program_price.price_measured` prices a timed op at its own time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cost import op_modules, program_ops, program_price
from moejax.cost import program as program_lib
from moejax.study import op_timing, program_calibration


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def _run_module(module, args, mesh):
  """The module's result on the first device, run replicated over the mesh."""
  executable = op_timing._compile(*module, list(mesh.devices.flat))  # pylint: disable=protected-access
  placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) for a in args]
  return [np.asarray(out[0]) for out in executable.execute_sharded(placed).disassemble_into_single_device_arrays()]


def _single_op_module(compiled, args):
  """(the module of the program's one op, the program's args in the order of its operands: the module's parameters)."""
  modules = op_modules.standalone_modules(compiled.as_text())
  assert len(modules) == 1, modules
  ((name, module),) = modules.items()
  return module, _operands(compiled, name, args)


def _operands(compiled, name, args):
  """`args` (the program's) as op `name` reads them: each of its operands is one of the entry's parameters."""
  computations, entry = program_lib.computations_of(compiled.as_text())
  lines = {inst[0]: inst for inst in computations[entry]}
  number = lambda operand: int(lines[operand][3].split(")")[0])  # 'parameter(k)'
  return [args[number(o)] for o in dict.fromkeys(program_lib.operands(lines[name][3]))]


def test_an_elementwise_fusion_module_computes_the_fused_op(mesh_2x4):
  rng = np.random.default_rng(1)
  a, b = (rng.normal(size=(64, 48)).astype(np.float32) for _ in range(2))
  module, args = _single_op_module(_compiled(lambda x, y: jnp.tanh(x) * y + 1.0, a, b), [a, b])
  assert not module[1]  # compiled as it stands, without XLA's passes
  (out,) = _run_module(module, args, mesh_2x4)
  np.testing.assert_allclose(out, np.tanh(a.astype(np.float64)) * b + 1.0, rtol=1e-5, atol=1e-6)


def test_a_matmul_module_computes_the_product(mesh_2x4):
  rng = np.random.default_rng(2)
  a, b = rng.normal(size=(96, 64)).astype(np.float32), rng.normal(size=(64, 80)).astype(np.float32)
  compiled = _compiled(lambda x, y: x @ y, a, b)
  (op,) = [o for o in program_ops.ops(compiled) if o.category == "matmul"]
  module = op_modules.standalone_modules(compiled.as_text())[op.name]
  (out,) = _run_module(module, _operands(compiled, op.name, [a, b]), mesh_2x4)
  np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


def test_a_sort_module_sorts(mesh_2x4):
  keys = np.random.default_rng(3).permutation(4096).astype(np.int32)
  module, args = _single_op_module(_compiled(lambda k: jnp.sort(k), keys), [keys])
  (out,) = _run_module(module, args, mesh_2x4)
  np.testing.assert_array_equal(out, np.sort(keys))


def test_ops_that_differ_only_in_numbering_share_a_module():
  shape = jax.ShapeDtypeStruct((32, 16), jnp.float32)
  other = jax.ShapeDtypeStruct((32, 8), jnp.float32)

  def twice(x, y, z):  # the same op on two arrays of one shape, and on a third shape
    return jnp.sort(jnp.exp(x), axis=0), jnp.sort(jnp.exp(y), axis=0), jnp.sort(jnp.exp(z), axis=0)

  modules = op_modules.standalone_modules(_compiled(twice, shape, shape, other).as_text())
  by_module = op_modules.distinct(modules)
  assert len(by_module) < len(modules)
  assert any(len(names) >= 2 for names in by_module.values())
  shapes = {m[0].count("f32[32,16]") > 0 for m in by_module}
  assert shapes == {True, False}  # the third shape keeps modules of its own


def test_the_timer_times_every_op_and_reports_a_module_xla_refuses(mesh_2x4):
  rng = np.random.default_rng(4)
  a, b = rng.normal(size=(128, 64)).astype(np.float32), rng.normal(size=(64, 32)).astype(np.float32)
  compiled = _compiled(lambda x, y: jnp.sort(jnp.tanh(x @ y), axis=0), a, b)
  timer = op_timing.OpTimer(mesh_2x4)
  launch = 1e-6
  seconds = timer.op_seconds(compiled.as_text(), 2, launch)
  assert set(seconds) == {o.name for o in program_ops.ops(compiled)}
  assert all(s >= launch for s in seconds.values())
  before = dict(timer.seconds)
  bad = ("HloModule bad\n\nENTRY %main {\n  ROOT %x = f32[4]{0} not-an-op()\n}\n", False)
  timer.time([bad, *before], 2)
  assert bad in timer.failed and "not-an-op" in timer.failed[bad]
  assert timer.seconds == before  # timed modules are not timed again


def test_price_measured_prices_a_timed_op_at_its_own_time(mesh_2x4):
  shape = jax.ShapeDtypeStruct((256, 128), jnp.float32)
  compiled = _compiled(lambda x: jnp.sort(jnp.exp(x), axis=0) * 2.0, shape)
  ops = program_ops.ops(compiled)
  terms = program_calibration.Terms({}, flops_per_s=1e10, bytes_per_s=1e9, launch_s=2e-6, call_s=5e-5)
  own = {ops[0].name: 0.25}  # one op timed, the rest by category
  priced = program_price.price_measured(compiled, mesh_2x4, terms, op_seconds=own).compute_s
  expected = terms.call_s + ops[0].count * 0.25
  expected += sum(o.count * terms.op_seconds(o.category, o.flops, o.bytes) for o in ops[1:])
  assert priced == pytest.approx(expected, rel=1e-12)
  assert priced != pytest.approx(program_price.price_measured(compiled, mesh_2x4, terms).compute_s, rel=1e-3)
