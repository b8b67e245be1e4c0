"""A 4-operand all-reduce beside a chain of 7 all-to-alls or after it, on the 2-process 2 x 4 mesh (README.md)."""

from moejax.runtime import distributed

distributed.initialize()
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.runtime import mesh as mesh_lib
from moejax.study import program_calibration as pc

mesh = mesh_lib.make_mesh(2, 4)
ax = ("node", "gpu")


def a2a_chain(a):
  for _ in range(7):
    a = jax.lax.all_to_all(a, ax, 0, 0, tiled=True)
  return a


def independent(a, s):
  return a2a_chain(a), jax.lax.psum((s, s * 2, s * 3, s * 4), ax)


def dependent(a, s):
  a = a2a_chain(a)
  s = s + a[:1, :1].sum()
  return a, jax.lax.psum((s, s * 2, s * 3, s * 4), ax)


def only_chain(a, s):
  return a2a_chain(a), s


def only_ar(a, s):
  return a, jax.lax.psum((s, s * 2, s * 3, s * 4), ax)


spec = (P(ax), P(ax))
a = jnp.ones((8 * 64, 8), jnp.float32)
s = jnp.ones((8 * 1, 2), jnp.float32)
args = pc.placed((a, s), mesh)
for trial in range(3):
  out = {}
  for name, f in [("chain", only_chain), ("ar4", only_ar), ("independent", independent), ("dependent", dependent)]:
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    out[name] = pc.median_seconds(fn, args, 15) * 1e3
  if jax.process_index() == 0:
    print("trial", trial, " ".join(f"{k} {v:.1f}" for k, v in out.items()), "ms", flush=True)
