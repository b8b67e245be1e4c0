"""A measured point's repeats (`moejax.study.repeats`): the median's interval against the binomial coverage it
claims, the stop rule on a scripted clock, and the sweep's checks of the measure section."""

import math

import pytest

from configs import scaling_default
from moejax.study import repeats as repeats_lib
from moejax.study import sweep_checks
from moejax.validation import ConfigError


def coverage(n: int, low_rank: int, high_rank: int) -> float:
  """P(x_(low) <= median < x_(high)) for n draws of a continuous distribution: Binomial(n, 1/2) in [low, high)."""
  return sum(math.comb(n, i) for i in range(low_rank, high_rank)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 9, 10, 20, 31, 100])
def test_median_interval_covers_the_median_at_least_95_percent_and_is_the_narrowest_that_does(n):
  times = [float(t) for t in reversed(range(1, n + 1))]  # sorted value k is rank k
  low, high = repeats_lib.median_interval(times)
  assert 1 <= low <= high <= n and low + high == n + 1  # the j-th from either end
  assert coverage(n, int(low), int(high)) >= 0.95
  assert low + 1 > high - 1 or coverage(n, int(low) + 1, int(high) - 1) < 0.95


@pytest.mark.parametrize("n", [1, 3, 5])
def test_below_six_times_no_interval_covers_95_percent_and_nothing_is_stable(n):
  assert coverage(n, 1, n) < 0.95  # min and max: 3 times cover 75%
  assert repeats_lib.median_interval([1.0] * n) is None
  assert not repeats_lib.stable([1.0] * n, 0.5)


class ScriptedClock:
  """perf_counter returning the start and end of each call so that call i lasts durations[i]."""

  def __init__(self, durations):
    self.ticks = [t for d in durations for t in (0.0, d)]

  def __call__(self):
    return self.ticks.pop(0)


def run(monkeypatch, durations, warmup, repeats):
  monkeypatch.setattr(repeats_lib.time, "perf_counter", ScriptedClock(durations))
  calls = []
  times = repeats_lib.timed(lambda: calls.append(1), warmup, repeats)
  return times, len(calls)


def test_steady_calls_stop_at_the_least(monkeypatch):
  times, calls = run(monkeypatch, [0.1] * 50, 2, repeats_lib.Repeats(7, 30, 0.05))
  assert times == [0.1] * 7 and calls == 1 + 2 + 7


def test_steady_calls_with_a_lower_least_stop_at_the_sixth(monkeypatch):
  times, _ = run(monkeypatch, [0.1] * 50, 0, repeats_lib.Repeats(3, 30, 0.05))
  assert times == [0.1] * 6


def test_noisy_calls_run_to_the_most(monkeypatch):
  durations = [1.0 if i % 2 else 2.0 for i in range(50)]  # the median's interval spans both values: never stable
  times, calls = run(monkeypatch, durations, 0, repeats_lib.Repeats(3, 12, 0.05))
  assert times == durations[:12] and calls == 1 + 12


def test_an_outlier_early_needs_more_calls_then_stops(monkeypatch):
  durations = [5.0, 1.0, 1.0] + [1.0] * 40
  times, _ = run(monkeypatch, durations, 0, repeats_lib.Repeats(3, 30, 0.05))
  assert 3 < len(times) < 30
  assert repeats_lib.stable(times, 0.05) and not repeats_lib.stable(times[:-1], 0.05)


def test_an_int_is_exactly_that_many_calls(monkeypatch):
  durations = [1.0 if i % 2 else 2.0 for i in range(50)]
  times, calls = run(monkeypatch, durations, 1, 4)
  assert len(times) == 4 and calls == 1 + 1 + 4


@pytest.mark.parametrize(
  "update,field",
  [
    (dict(repeats=10, max_repeats=5), "measure.max_repeats"),
    (dict(max_repeats=0), "measure.max_repeats"),
    (dict(spread=0.0), "measure.spread"),
    (dict(spread=1.5), "measure.spread"),
    (dict(repeats=0), "measure.repeats"),
    (dict(repeats=10, layer_max_repeats=5), "measure.layer_max_repeats"),
  ],
)
def test_bad_measure_settings_are_refused_naming_the_field(update, field):
  config = scaling_default.get_config()
  config.measure.update(update)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    sweep_checks.check_sim_and_measure(config)
