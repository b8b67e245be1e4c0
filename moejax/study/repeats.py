"""How many times a measured point's programs are timed: at least `least` calls, then more until the median is
stable, at most `most`. Stable: the median's ~95% confidence interval from the order statistics (the sorted
times at n/2 -+ 0.98 sqrt(n), distribution-free) is at most `spread` of the median on each side, so noisy
programs get more calls and quiet ones stop early. With several processes the first decides after each call (a
broadcast), so every process runs the same calls of a program that spans them all."""

import dataclasses
import math
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils


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


def _agreed(decision: bool) -> bool:
  """The first process's decision, on every process."""
  if jax.process_count() == 1:
    return decision
  return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))


def timed(fn, warmup: int, repeats: "Repeats | int") -> list[float]:
  """Seconds of each timed call of `fn()` (blocked on its result), after a compiling call and `warmup` untimed
  ones: `repeats.least` calls, then one more at a time until `stable` or `repeats.most`. An int: exactly that
  many."""
  if isinstance(repeats, int):
    repeats = Repeats(repeats, repeats)
  for _ in range(1 + warmup):
    jax.block_until_ready(fn())
  times = []
  while True:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
    if len(times) >= repeats.least and _agreed(len(times) >= repeats.most or stable(times, repeats.spread)):
      return times
