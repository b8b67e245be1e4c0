"""An all-reduce of 1 and of 4 operands at 1-64 floats per device and operand on the 2-process 2 x 4 mesh (README.md)."""

from moejax.runtime import distributed

distributed.initialize()
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.runtime import mesh as mesh_lib
from moejax.study import program_calibration as pc

mesh = mesh_lib.make_mesh(2, 4)
for axes in [("node", "gpu"), ("gpu",)]:
  for trial in range(2):
    out = []
    for floats in (1, 2, 4, 8, 16, 64):

      def f(*xs):
        return jax.lax.psum(xs, axes)

      four = pc.placed(tuple(jnp.full((8, floats), i + 1.0, jnp.float32) for i in range(4)), mesh)
      fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("node", "gpu")),) * 4, out_specs=(P(("node", "gpu")),) * 4))
      one = pc.placed((jnp.ones((8, floats), jnp.float32),), mesh)
      fn1 = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("node", "gpu")),), out_specs=(P(("node", "gpu")),)))
      out.append(f"{floats}f: {pc.median_seconds(fn1, one, 11) * 1e3:.1f}/{pc.median_seconds(fn, four, 11) * 1e3:.1f}")
    if jax.process_index() == 0:
      print(",".join(axes), "trial", trial, "  1 op / 4 ops (ms):", "  ".join(out), flush=True)
