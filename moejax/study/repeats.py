"""How many times a measured point's programs are timed: at least `least` calls, then more until the median is
stable, at most `most`. Stable: the median's 95% confidence interval from the order statistics (distribution-free:
the j-th smallest and largest times, j the largest for which Binomial(n, 1/2) covers at least 95%) is at most
`spread` of the median on each side, so noisy programs get more calls and quiet ones stop early. Below 6 calls no
pair of order statistics covers 95% (min and max of 3 cover 75%), so nothing is stable before the sixth: on the
2-process CPU job a layer's calls spread over 2x (47-108 ms), and 3 calls that happened to agree stopped it.
With several processes, those of the program's mesh stop together: after each call they take the least of their
decisions over the mesh's devices (a collective of those processes alone: a point may span some hosts of a job), so
each runs the same calls of a program that spans them all."""

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

COVERAGE = 0.95  # of the median's interval that `stable` reads


@dataclasses.dataclass(frozen=True)
class Repeats:
  """least: timed calls always made; most: the cap (= least: exactly `least`); spread: the relative half-width
  of the median's confidence interval that stops the calls."""

  least: int
  most: int
  spread: float = 0.05

  @classmethod
  def of(cls, measure, cap: str = "max_repeats") -> "Repeats":
    """From a sweep's `measure` section (repeats, spread and the cap `cap`: max_repeats, or layer_max_repeats for a
    layer forward, cheap beside a step; checked in `sweep_checks`)."""
    return cls(measure.repeats, max(measure.get(cap, measure.repeats), measure.repeats), measure.spread)


def median_interval(times: list[float]) -> tuple[float, float] | None:
  """The distribution-free 95% confidence interval of the median of `times`: two of the sorted times, the j-th from
  either end with j the largest whose coverage P(j <= Binomial(n, 1/2) <= n - j) is at least COVERAGE; None below
  6 times (no pair covers it)."""
  ordered, n = sorted(times), len(times)
  j = 0  # 0-based: ordered[j] and ordered[n - 1 - j]
  while j + 1 <= n - 2 - j and _coverage(n, j + 1) >= COVERAGE:
    j += 1
  return (ordered[j], ordered[n - 1 - j]) if _coverage(n, j) >= COVERAGE else None


def _coverage(n: int, j: int) -> float:
  """P(x_(j) <= median <= x_(n-1-j)) (0-based ranks) for n draws of a continuous distribution."""
  return sum(math.comb(n, i) for i in range(j + 1, n - j)) / 2**n


def stable(times: list[float], spread: float) -> bool:
  """Whether the median's confidence interval reaches at most `spread` x the median either side of it (never
  below 6 times)."""
  interval = median_interval(times)
  if interval is None:
    return False
  low, high = interval
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
