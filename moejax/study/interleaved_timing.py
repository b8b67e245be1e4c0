"""Programs timed in rounds: each called once (it compiles and warms), then `repeats` rounds that call every program
once, in order; each program's median over the rounds. A burst of noise on the host (the other process's
compiles, a core taken away) then lands on every program alike, where timing each program's calls back to back puts
all of it into the few that ran during it. Every process of a job calls the same programs in the same order.

A program may be (fn, args, before): `before()` is called, untimed, right before each timed call (a barrier that
lines the job's processes up for a program that holds no collective of its own)."""

import statistics
import time

import jax


def medians(programs: list[tuple], repeats: int) -> list[float]:
  """Median wall seconds of each (fn, args) of `programs` over `repeats` interleaved rounds (module docstring)."""
  return [statistics.median(seconds) for seconds in samples(programs, repeats)]


def samples(programs: list[tuple], repeats: int, warm: bool = True) -> list[list[float]]:
  """Wall seconds of each (fn, args) or (fn, args, before) of `programs` in each of `repeats` interleaved rounds
  (module docstring); with `warm` False no untimed call first (programs timed before, their medians taken over many
  rounds)."""
  for fn, args, *_ in programs if warm else ():
    jax.block_until_ready(fn(*args))
  times = [[] for _ in programs]
  for _ in range(repeats):
    for (fn, args, *before), seconds in zip(programs, times):
      for call in before:
        jax.block_until_ready(call())
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      seconds.append(time.perf_counter() - start)
  return times


def median_seconds(fn, args, repeats: int) -> float:
  """Median wall seconds of `repeats` calls of fn(*args), after one call that compiles and warms."""
  return medians([(fn, args)], repeats)[0]
