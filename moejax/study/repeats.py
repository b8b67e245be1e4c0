"""How many times a measured point's programs are timed: at least `least` calls, then more until the median is
stable, at most `most`. Stable: the median's ~95% confidence interval from the order statistics (the sorted
times at n/2 -+ 0.98 sqrt(n), distribution-free) is at most `spread` of the median on each side, so noisy
programs get more calls and quiet ones stop early. With several processes, those of the program's mesh stop together:
after each call they take the least of their decisions over the mesh's devices (a collective of those processes
alone: a point may span some hosts of a job), so each runs the same calls of a program that spans them all."""

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Repeats:
  """least: timed calls always made; most: the cap (= least: exactly `least`); spread: the relative half-width
  of the median's confidence interval that stops the calls."""

  least: int
  most: int
  spread: float = 0.05

  @classmethod
  def of(cls, measure) -> "Repeats":
    """From a sweep's `measure` section (repeats, max_repeats, spread; checked in `sweep_checks`)."""
    return cls(measure.repeats, max(measure.get("max_repeats", measure.repeats), measure.repeats), measure.spread)


def median_interval(times: list[float]) -> tuple[float, float]:
  """The ~95% distribution-free confidence interval of the median of `times`: two of the sorted times."""
  ordered, n = sorted(times), len(times)
  half = 0.98 * math.sqrt(n)
  return ordered[max(math.floor(n / 2 - half), 0)], ordered[min(math.ceil(n / 2 + half), n - 1)]


def stable(times: list[float], spread: float) -> bool:
  """Whether the median's confidence interval reaches at most `spread` x the median either side of it."""
  low, high = median_interval(times)
  middle = statistics.median(times)
  return middle - low <= spread * middle and high - middle <= spread * middle


def _agreed(stop: bool, mesh) -> bool:
  """Whether every process of `mesh` stops (all but a single process's job: the least over the mesh's devices)."""
  if jax.process_count() == 1:
    return stop
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  flags = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P(mesh.axis_names)), np.full((local,), stop, np.int32), (mesh.devices.size,)
  )
  return bool(jax.jit(jnp.min, out_shardings=NamedSharding(mesh, P()))(flags))


def timed(fn, warmup: int, repeats: "Repeats | int", mesh=None) -> list[float]:
  """Seconds of each timed call of `fn()` (blocked on its result), after a compiling call and `warmup` untimed
  ones: `repeats.least` calls, then one more at a time until `stable` or `repeats.most`. An int: exactly that
  many. `mesh`: the devices `fn`'s program spans, whose processes stop together; in a job of several processes
  without it, `repeats.most` calls."""
  if isinstance(repeats, int):
    repeats = Repeats(repeats, repeats)
  if mesh is None and jax.process_count() > 1:
    repeats = Repeats(repeats.most, repeats.most)
  for _ in range(1 + warmup):
    jax.block_until_ready(fn())
  times = []
  while True:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
    if len(times) >= repeats.least and (
      repeats.least == repeats.most or _agreed(len(times) >= repeats.most or stable(times, repeats.spread), mesh)
    ):
      return times
