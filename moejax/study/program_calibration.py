"""The terms a compiled program's price needs, measured on the mesh at hand by microbenchmarks only (no measured point
is fitted): per collective kind and mesh axes a launch time and a time per byte, and the device's compute and memory
rates with every device of the mesh busy at once (simulated CPU devices share the host's cores: one busy device's rate
is not the mesh's).

  terms = measure(mesh)                       # {(kind, axes): (alpha_s, beta_s_per_byte)}, rates
  program_price.price_measured(compiled, mesh, terms)

Each collective is timed at two sizes per device (`SIZES`: a size exchange's few bytes and a row block's), as its own
jitted shard_map program (median of `repeats` calls after one warm-up); alpha and beta are the line through the two
medians (beta clipped at 0: the small size's noise must not make bytes free of cost).
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SIZES = (256, 1 << 20)  # bytes per device: a plan's size exchange, a block of rows
RATE_SIDE = 512  # the matmul timed for the compute rate: [devices x 512, 512] @ [512, 512] per device


@dataclasses.dataclass(frozen=True)
class Terms:
  """per_kind: {(kind, axes): (alpha_s, beta_s_per_byte)}; flops_per_s, bytes_per_s: one device's rates with every
  device busy."""

  per_kind: dict
  flops_per_s: float
  bytes_per_s: float

  def as_dict(self) -> dict:
    rows = [dict(kind=k, axes=list(a), alpha_s=v[0], beta_s_per_byte=v[1]) for (k, a), v in self.per_kind.items()]
    return dict(collectives=rows, flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s)


def median_seconds(fn, args, repeats: int) -> float:
  """Median wall seconds of `repeats` calls of fn(*args), after one call that compiles and warms."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _body(kind: str, axes: tuple[str, ...], mesh):
  """One collective of `kind` over `axes` on a device's [rows, 8] f32 block."""
  if kind == "all-reduce":
    return lambda a: jax.lax.psum(a, axes)
  if kind == "all-gather":
    return lambda a: jax.lax.all_gather(a, axes, tiled=True)[: a.shape[0]]
  if kind == "reduce-scatter":
    return lambda a: jax.lax.psum_scatter(a, axes, scatter_dimension=0, tiled=True)
  if kind == "all-to-all":
    return lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  size = int(np.prod([mesh.shape[a] for a in axes]))  # a ring shift: every device sends its block to the next
  return lambda a: jax.lax.ppermute(a, axes, [(i, (i + 1) % size) for i in range(size)])


def time_collective(kind: str, axes: tuple[str, ...], nbytes: int, mesh, repeats: int) -> float:
  """Median seconds of one `kind` over `axes` moving `nbytes` per device (f32 blocks of 8 columns)."""
  everything = tuple(mesh.axis_names)
  rows = max(1, nbytes // 32)
  rows += (-rows) % int(np.prod([mesh.shape[a] for a in axes]))  # all-to-all, reduce-scatter split rows
  fn = jax.jit(jax.shard_map(_body(kind, axes, mesh), mesh=mesh, in_specs=P(everything), out_specs=P(everything)))
  x = jnp.ones((mesh.devices.size * rows, 8), jnp.float32)
  return median_seconds(fn, (x,), repeats)


def line(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
  """(alpha, beta) of the line through (bytes, seconds) points small and large, beta clipped at 0."""
  beta = max(0.0, (large[1] - small[1]) / (large[0] - small[0]))
  return small[1] - beta * small[0], beta


def axis_sets(mesh) -> list[tuple[str, ...]]:
  """Each axis of more than one device alone, and all of them together where several are."""
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  return [(a,) for a in axes] + ([tuple(axes)] if len(axes) > 1 else [])


def measure(mesh, repeats: int = 9, kinds=KINDS, timer=time_collective, say=print) -> Terms:
  """Every kind over every axis set of `mesh` (`axis_sets`) at SIZES, and the rates; `timer(kind, axes, nbytes,
  mesh, repeats)` (tests pass their own)."""
  per_kind = {}
  for kind in kinds:
    for axes in axis_sets(mesh):
      points = [(size, timer(kind, axes, size, mesh, repeats)) for size in SIZES]
      per_kind[(kind, axes)] = line(*points)
      say(
        f"{kind:<20}{','.join(axes):<10} {per_kind[(kind, axes)][0] * 1e6:9.1f} us + {per_kind[(kind, axes)][1] * 1e9:7.3f} ns/B"
      )
  flops, nbytes = rates(mesh, repeats)
  say(f"device rates with all {mesh.devices.size} busy: {flops / 1e9:.2f} GFLOP/s, {nbytes / 1e9:.2f} GB/s")
  return Terms(per_kind, flops, nbytes)


def rates(mesh, repeats: int) -> tuple[float, float]:
  """(FLOP/s, bytes/s) of one device while every device of the mesh runs: a [512, 512] matmul per device, and a
  scaled copy of 4 MiB per device (one read, one write)."""
  everything = tuple(mesh.axis_names)
  devices, side = mesh.devices.size, RATE_SIDE
  matmul = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P(everything), P()), out_specs=P(everything)))
  a, b = jnp.ones((devices * side, side), jnp.float32), jnp.ones((side, side), jnp.float32)
  flops = 2 * side**3 / median_seconds(matmul, (a, b), repeats)
  elements = 1 << 20
  scale = jax.jit(jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P(everything), out_specs=P(everything)))
  x = jnp.ones((devices * elements,), jnp.float32)
  return flops, 2 * 4 * elements / median_seconds(scale, (x,), repeats)
