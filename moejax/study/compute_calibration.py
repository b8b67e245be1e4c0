"""A device's compute terms with every device of the mesh busy at once (simulated CPU devices share the host's cores:
one busy device's rate is not the mesh's): the compute fields of `moejax.study.program_calibration.Terms`, by
microbenchmarks only.

  programs, found = compute_programs(mesh)
  compute_from(found, interleaved_timing.medians(programs, repeats))  # {flops_per_s, bytes_per_s, ...}

The benchmarks hold no collective, so nothing lines their calls up across the job's processes: a process starts one
up to a few ms after the other, and a call of a few ms then ran with the other process's devices partly idle (on the
2-process CPU job the matmul's samples fell in two groups, about 4 ms and about 7 ms, the median anywhere between:
37 to 70 GFLOP/s from run to run). Each call is therefore timed right after a barrier (`barrier`, untimed: a tiny
all-reduce over every device). Calls back to back instead line up too, but run warm: on 1 x 4 they read 69 GFLOP/s
where the layer's matmuls ran at about 40.

Each benchmark is a jit(shard_map) over every device, its ops listed by `program_ops` as a program's are (rates in
the units ops are priced in): chains of tiny unfusable ops at two lengths (slope: an op's launch; intercept: a call);
a 512 x 512 matmul (FLOP/s); a scaled copy of 4 MiB (elementwise bytes/s); 2048 rows of 128 f32 gathered from and
scatter-added into an [8192, 128] table, an argsort of 16384 int32 keys (bytes/s). A rate is its category's work over
the time left after the call, the launches and the other ops at the rates measured before.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.cost import program_ops
from moejax.study.program_calibration import Terms, line, placed

RATE_SIDE = 512  # the matmul timed for the compute rate: [devices x 512, 512] @ [512, 512] per device
TABLE, PICKED, WIDTH = 8192, 2048, 128  # the gather's and scatter's [TABLE, WIDTH] f32 table and rows picked
SORTED = 16384  # keys per device in the argsort
CHAINS = (32, 128)  # tiny ops in the two chains timed for the launch
BENCHMARKS = ("elementwise", "matmul", "gather", "scatter", "sort")  # in this order: later rates use earlier ones


def compute_programs(mesh) -> tuple[list, list]:
  """([(compiled, args, barrier)], each one's ops listed by `program_ops`) of the CHAINS launch chains, then the
  BENCHMARKS (module docstring), each a jit(shard_map) over every device, timed after `barrier(mesh)`
  (`interleaved_timing.samples`)."""
  devices, rng = mesh.devices.size, np.random.default_rng(0)
  rows = jnp.asarray(rng.integers(0, TABLE, devices * PICKED), jnp.int32)
  benchmarks = (
    (lambda x: x * 2.0, (jnp.ones((devices << 20,), jnp.float32),)),
    (lambda a, b: a @ b[0], (jnp.ones((devices * RATE_SIDE, RATE_SIDE)), jnp.ones((devices, RATE_SIDE, RATE_SIDE)))),
    (lambda t, i: t.at[i].get(mode="promise_in_bounds"), (jnp.ones((devices * TABLE, WIDTH)), rows)),
    (lambda i, u: jnp.zeros((TABLE, WIDTH)).at[i].add(u, mode="promise_in_bounds"),
     (rows, jnp.ones((devices * PICKED, WIDTH)))),
    (lambda k: jnp.argsort(k, stable=True).astype(jnp.int32),
     (jnp.asarray(rng.integers(0, 1 << 30, devices * SORTED), jnp.int32),)),
  )  # fmt: skip
  bodies = [(_launch_chain(links), (jnp.ones((devices * 8,)),)) for links in CHAINS]
  programs, sync = [], barrier(mesh)
  for body, args in bodies + list(benchmarks):
    args = placed(args, mesh)
    programs.append((_everywhere(body, mesh, len(args)).lower(*args).compile(), args, sync))
  return programs, [program_ops.ops(compiled) for compiled, *_ in programs]


def barrier(mesh):
  """A call that returns once every device of `mesh` has reached it: an all-reduce of one float over every axis."""
  ones = placed((jnp.ones((mesh.devices.size,)),), mesh)
  compiled = _everywhere(lambda x: jax.lax.psum(x, tuple(mesh.axis_names)), mesh, 1).lower(*ones).compile()
  return lambda: compiled(*ones)


def compute_from(found: list, seconds: list) -> dict:
  """Terms' compute fields (flops_per_s: matmul, bytes_per_s: elementwise, op_bytes_per_s: {'gather' | 'scatter' |
  'sort': bytes/s}, launch_s, call_s) from `compute_programs`' ops `found` and their `seconds`."""
  # An op's launch and a call's cost: the line through the chains (per listed op run; both clipped at 0).
  call, launch = line(*[(sum(o.count for o in ops), s) for ops, s in zip(found, seconds[: len(CHAINS)])])
  call = max(0.0, call)
  terms = Terms({}, 1.0, 1.0, launch_s=launch, call_s=call)
  rates = {}
  for category, ops, s in zip(BENCHMARKS, found[len(CHAINS) :], seconds[len(CHAINS) :]):
    if any(o.category == category for o in ops):  # else XLA expanded the op (a scatter into a loop of slices)
      rates[category] = category_rate(category, ops, s, terms)
    terms = Terms({}, rates.get("matmul", 1.0), rates["elementwise"], dict(rates), launch, call)
  flops, nbytes = rates.pop("matmul"), rates.pop("elementwise")  # both always listed
  return dict(flops_per_s=flops, bytes_per_s=nbytes, op_bytes_per_s=rates, launch_s=launch, call_s=call)


def _launch_chain(links: int):
  """A chain of `links` tiny ops that do not fuse (a sort of 8 floats, then a scale), timed for an op's launch."""

  def chain(x):
    for _ in range(links):
      x = jnp.sort(x * 1.5 + 1.0)
    return x

  return chain


def _everywhere(body, mesh, arity: int):
  """jit(shard_map(body)) over every device, each argument and the result split along their first dim."""
  everything = tuple(mesh.axis_names)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(everything),) * arity, out_specs=P(everything)))


def category_rate(category: str, found: list, seconds: float, terms: Terms) -> float:
  """The rate of `category` (FLOP/s for 'matmul', else bytes/s) that a program of ops `found` taking `seconds`
  implies: its category's work over the seconds left after the call, every op's launch and the other categories'
  ops at `terms` (at least a tenth of the time is left to the category: a noisy run must not make it free)."""
  work = sum(o.count * (o.flops if category == "matmul" else o.bytes) for o in found if o.category == category)
  others = sum(o.count * terms.op_seconds(o.category, o.flops, o.bytes) for o in found if o.category != category)
  left = seconds - terms.call_s - others - terms.launch_s * sum(o.count for o in found if o.category == category)
  return work / max(left, 0.1 * seconds)
