"""The layer's statistics summed in packed all-reduces (`moejax.moe.packed_sums`): the sums against NumPy's over the
devices' own values, on a 2 x 4 mesh, and one all-reduce operand per (axes, dtype) in the compiled program, the
layer's included."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.cost import program as program_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.packed_sums import psum_packed
from moejax.moe.params import init_params
from moejax.runtime.mesh import GPU, NODE

AXES = (NODE, GPU)


def _packed_program(mesh):
  """jit(shard_map) of psum_packed over a nested float tree and int leaves, summed over both axes or one."""

  def body(f_AxE, g_A, i_AxE, j_A):
    named = {
      "stats": ({"counts": f_AxE[0], "pair": (g_A[0], g_A[0] * 2.0)}, AXES),
      "dropped": (j_A[0], AXES),
      "histogram": (i_AxE[0], AXES),
      "per_node": (i_AxE[0] * 3, (GPU,)),
    }
    out = psum_packed(named)
    return (
      out["stats"]["counts"][None],
      out["stats"]["pair"][1][None],
      out["dropped"][None],
      out["histogram"][None],
      (out["per_node"][None]),
    )

  spec = P(AXES)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 5))


def test_packed_sums_equal_numpys_sums_over_the_devices_values(mesh_2x4):
  rng = np.random.default_rng(7)
  devices = mesh_2x4.devices.size
  f_AxE = rng.normal(size=(devices, 5)).astype(np.float32)
  g_A = rng.normal(size=(devices,)).astype(np.float32)
  i_AxE = rng.integers(0, 1 << 20, size=(devices, 5)).astype(np.int32)
  j_A = rng.integers(0, 1000, size=(devices,)).astype(np.int32)
  counts, pair, dropped, histogram, per_node = _packed_program(mesh_2x4)(f_AxE, g_A, i_AxE, j_A)
  f64 = f_AxE.astype(np.float64)
  np.testing.assert_allclose(np.asarray(counts), np.broadcast_to(f64.sum(0), (devices, 5)), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(pair), np.full(devices, 2.0 * g_A.astype(np.float64).sum()), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(dropped), np.full(devices, j_A.sum()))
  np.testing.assert_array_equal(np.asarray(histogram), np.broadcast_to(i_AxE.sum(0), (devices, 5)))
  nodes = i_AxE.reshape(2, 4, 5).sum(1) * 3  # per_node: over 'gpu' only, within each node
  np.testing.assert_array_equal(np.asarray(per_node), np.repeat(nodes, 4, axis=0))


def test_one_all_reduce_operand_per_axes_and_dtype(mesh_2x4):
  args = (np.ones((8, 5), np.float32), np.ones(8, np.float32), np.ones((8, 5), np.int32), np.ones(8, np.int32))
  compiled = _packed_program(mesh_2x4).lower(*args).compile()
  reduces = [c for c in program_lib.collectives(compiled, mesh_2x4) if c.kind == "all-reduce"]
  by_axes = {}
  for c in reduces:
    by_axes[c.axes] = by_axes.get(c.axes, 0) + c.operands
  assert by_axes == {AXES: 2, (GPU,): 1}  # float and int over both axes; int over 'gpu'


def test_the_layers_statistics_take_one_operand_per_dtype(mesh_2x4):
  cfg = MoEConfig(num_experts=16, top_k=1, d_model=32, d_ff=64, path="flat", collective="capacity", num_nodes=2,
                  capacity_factor=2.0)  # fmt: skip
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (256, cfg.d_model), jnp.float32)
  compiled = jax.jit(lambda p, v: moe_apply(p, v, cfg, mesh_2x4)).lower(params, x).compile()
  reduces = [c for c in program_lib.collectives(compiled, mesh_2x4) if c.kind == "all-reduce" and c.axes == AXES]
  # Before packing: 9 operands in two all-reduces (the router's statistics, the exchange's counts), and the traffic's.
  assert sum(c.operands for c in reduces) <= 2, [(c.name, c.operands, c.dtype) for c in reduces]
