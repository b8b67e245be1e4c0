"""moejax.study.progress: `i/n what, elapsed, ETA` lines, and the sweep's log of them (the ETA counting only the
points it runs, not those stored by an earlier run)."""

import functools
import logging

import ml_collections
import pytest

from configs import scaling_default
from moejax.durations import duration
from moejax.study import sweep
from moejax.study.progress import Progress


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_duration_reads_as_seconds_minutes_or_hours():
  assert [duration(s) for s in (0, 42.4, 60, 185, 3599, 3600, 7620)] == [
    "0s",
    "42s",
    "1m00s",
    "3m05s",
    "59m59s",
    "1h00m",
    "2h07m",
  ]


def test_eta_is_the_mean_time_so_far_times_the_items_left():
  clock = Clock()
  bar = Progress(4, clock=clock)
  clock.now += 10
  assert bar.step("a") == "1/4 a, elapsed 10s, ETA 30s"
  clock.now += 50  # a slow item: the mean is now 30 s an item
  assert bar.step("b") == "2/4 b, elapsed 1m00s, ETA 1m00s"
  clock.now += 30
  bar.step("c")
  clock.now += 30
  assert bar.step("d") == "4/4 d, elapsed 2m00s, done"


@pytest.fixture
def fake_sweep(monkeypatch):
  """The sweep with its small runs and pricing stubbed (each point 'takes' 10 s of a fake clock)."""
  clock = Clock()

  def row(*args):
    clock.now += 10
    return {"layer_ms": 1.0, "label": "modelled"}

  monkeypatch.setattr(sweep, "Progress", functools.partial(Progress, clock=clock))
  monkeypatch.setattr(sweep, "simulation_key", lambda scheme, n, *args: f"{scheme} {n}")
  monkeypatch.setattr(sweep, "simulate", lambda *args: {})
  monkeypatch.setattr(sweep, "price_point_layer", lambda *args: None)
  monkeypatch.setattr(sweep, "model_row", row)


def sweep_config(**fields) -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.update(gpus_per_node=(2,), global_batch=16, **fields)
  config.models = ml_collections.ConfigDict(
    {"tiny": {"d_model": 32, "d_ff": 64, "layers": 2, "moe_layers": 1, "seq_len": 8, "micro_batch": 2, "vocab": 100}}
  )
  return config


def _progress_lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.name == "absl" and "elapsed" in r.getMessage()]


def test_the_sweep_logs_each_point_with_an_eta_over_the_points_it_runs(fake_sweep, tmp_path, caplog):
  config = sweep_config(schemes=("switch", "smile"), nodes=(1, 2), scalings=("weak",))
  with caplog.at_level(logging.INFO):
    sweep.run(config, str(tmp_path))
  lines = _progress_lines(caplog)
  assert [line.split()[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
  assert lines[0].endswith("elapsed 10s, ETA 30s") and lines[-1].endswith("elapsed 40s, done"), lines

  caplog.clear()
  config.nodes = (1, 2, 4)  # two points more; the four stored ones are skipped and not counted
  with caplog.at_level(logging.INFO):
    sweep.run(config, str(tmp_path))
  lines = _progress_lines(caplog)
  assert [line.split()[0] for line in lines] == ["1/2", "2/2"], lines
  assert lines[0].endswith("elapsed 10s, ETA 10s") and lines[1].endswith("elapsed 20s, done"), lines


def test_eta_goes_by_each_kinds_own_items_and_names_the_kinds_not_timed_yet():
  clock = Clock()
  bar = Progress({"measured": 3, "modelled": 4}, clock=clock)
  clock.now += 40
  assert bar.step("m1", "measured") == "1/7 m1, elapsed 40s, ETA 1m20s + 4 modelled"
  clock.now += 20  # measured items average 30 s now
  assert bar.step("m2", "measured") == "2/7 m2, elapsed 1m00s, ETA 30s + 4 modelled"
  clock.now += 30
  assert bar.step("m3", "measured") == "3/7 m3, elapsed 1m30s, ETA 4 modelled"
  clock.now += 2  # a modelled item's 2 s, not the measured ones' 30 s, prices the 3 left
  assert bar.step("s1", "modelled") == "4/7 s1, elapsed 1m32s, ETA 6s"
  for i in range(2):
    clock.now += 2
    bar.step(f"s{i + 2}", "modelled")
  clock.now += 2
  assert bar.step("s4", "modelled") == "7/7 s4, elapsed 1m38s, done"
  with pytest.raises(ValueError, match="'modelled'"):
    bar.step("one too many", "modelled")


def test_the_sweeps_eta_keeps_measured_points_per_mesh_apart_from_modelled_ones(
  fake_sweep, monkeypatch, tmp_path, caplog
):
  clock = sweep.Progress.keywords["clock"]

  def measured(point, *args):
    clock.now += 30 * point.nodes  # the 2-node point takes twice the 1-node one
    return {"layer_ms": 1.0, "label": "measured"}

  monkeypatch.setattr(sweep, "measure", measured)
  config = sweep_config(schemes=("switch",), nodes=(1, 2), scalings=("weak",))
  config.measure.platform = "cpu"
  with caplog.at_level(logging.INFO):
    sweep.run(config, str(tmp_path))
  lines = _progress_lines(caplog)
  assert [line.split()[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
  assert lines[0].endswith("elapsed 30s, ETA 1 measured 2x2 + 2 modelled"), lines
  assert lines[1].endswith("elapsed 1m30s, ETA 2 modelled"), lines
  assert lines[2].endswith("elapsed 1m40s, ETA 10s"), lines
