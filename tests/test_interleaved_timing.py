"""Programs timed in interleaved rounds (moejax.study.interleaved_timing): each warmed once, then every program once
a round, in order; each program's median over its own calls, read off a planted clock."""

import numpy as np

from moejax.study import interleaved_timing


def test_rounds_call_every_program_once_in_order_and_take_each_ones_median(monkeypatch):
  rng = np.random.default_rng()
  repeats, names = 5, ("a", "b", "c")
  planted = {name: list(rng.uniform(0.1, 2.0, repeats + 1)) for name in names}  # the warm-up's, then each round's
  clock, calls = [0.0], []
  monkeypatch.setattr(interleaved_timing.time, "perf_counter", lambda: clock[0])

  def program(name):
    def run():
      calls.append(name)
      clock[0] += planted[name][len([c for c in calls if c == name]) - 1]
      return np.zeros(1)

    return run, ()

  got = interleaved_timing.medians([program(name) for name in names], repeats)
  assert calls == list(names) * (repeats + 1)  # warm-ups, then the rounds
  np.testing.assert_allclose(got, [np.median(planted[name][1:]) for name in names], rtol=1e-12)


def test_unwarmed_rounds_time_every_call(monkeypatch):
  """samples(warm=False): no untimed call first; each round's call is timed, in order."""
  rng = np.random.default_rng()
  planted = list(rng.uniform(0.1, 2.0, 4))
  clock, calls = [0.0], []
  monkeypatch.setattr(interleaved_timing.time, "perf_counter", lambda: clock[0])

  def run():
    clock[0] += planted[len(calls)]
    calls.append(1)
    return np.zeros(1)

  got = interleaved_timing.samples([(run, ())], 4, warm=False)
  assert len(calls) == 4
  np.testing.assert_allclose(got, [planted], rtol=1e-12)


def test_a_programs_barrier_runs_right_before_each_timed_call_and_is_not_timed(monkeypatch):
  """(fn, args, before): before() is called before each round's call of fn, not before its warm-up, and its time
  (the wait for the job's other processes) is not fn's."""
  rng = np.random.default_rng()
  planted, waits = list(rng.uniform(0.1, 2.0, 4)), list(rng.uniform(1.0, 5.0, 3))
  clock, calls = [0.0], []
  monkeypatch.setattr(interleaved_timing.time, "perf_counter", lambda: clock[0])

  def run(x):
    clock[0] += planted[len([c for c in calls if c == "run"])]
    calls.append("run")
    return np.zeros(1) + x

  def barrier():
    clock[0] += waits[len([c for c in calls if c == "barrier"])]
    calls.append("barrier")
    return np.zeros(1)

  got = interleaved_timing.samples([(run, (1.0,), barrier)], 3)
  assert calls == ["run"] + ["barrier", "run"] * 3
  np.testing.assert_allclose(got, [planted[1:]], rtol=1e-12)
