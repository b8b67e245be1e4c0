"""The pipeline schedules' timetables against the published bubbles, and the dependency checker against wrong
slots. Durations are fresh random draws; the published formulas are written here, not taken from moejax."""

import dataclasses
import itertools

import numpy as np
import pytest

from moejax.pipeline import orders as slot_orders
from moejax.pipeline import schedules
from moejax.pipeline.timetable import Durations, check, simulate
from moejax.validation import ConfigError

SHAPES = list(itertools.product((2, 4, 8), (4, 8, 16)))


def _idles(table):
  return np.array([table.idle(d) for d in range(len(table.slots))])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubbles_are_published(name):
  """Unit F = B: the idle fraction is (p-1)/(m+p-1); any F, B: every device idles (p-1)(F+B) (DeepSeek-V3 Table 2)."""
  rng = np.random.default_rng(0)
  for p, m in SHAPES:
    table = schedules.timetable(name, p, m)
    check(table)
    assert table.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    f, b = rng.uniform(0.2, 3.0, 2)
    table = schedules.timetable(name, p, m, durations=Durations(f, b))
    check(table)
    np.testing.assert_allclose(_idles(table), (p - 1) * (f + b), rtol=1e-12)


def test_interleaved_bubble_is_megatrons():
  """Megatron (Narayanan et al. 2021): with v chunks a device idles (p-1)(f+b) at chunk times f, b, i.e. (p-1)/(vm)
  of the ideal time m v (f+b)."""
  rng = np.random.default_rng(1)
  for (p, m), v in itertools.product(SHAPES, (2, 3)):
    if m % p:
      with pytest.raises(ConfigError, match="micro_batches"):
        schedules.timetable("interleaved", p, m, v)
      continue
    f, b = rng.uniform(0.2, 3.0, 2)
    table = schedules.timetable("interleaved", p, m, v, Durations(f, b))
    check(table)
    np.testing.assert_allclose(_idles(table), (p - 1) * (f + b), rtol=1e-12)
    assert _idles(table)[0] / (m * v * (f + b)) == pytest.approx((p - 1) / (v * m), rel=1e-12)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_dualpipe_bubble_is_deepseeks(name):
  """DeepSeek-V3 Table 2: (PP/2-1)(F&B+B-3W), the busiest device's idle time, at the durations the figure is drawn
  for: the backward's input part as long as the forward (B = F + W, W <= F), and max(F, B) <= F&B <= F + B."""
  rng = np.random.default_rng(2)
  for p, m in SHAPES:
    least = 2 * p if name == "dualpipe" else p
    if m < least:
      with pytest.raises(ConfigError, match="micro_batches"):
        schedules.timetable(name, p, m)
      continue
    for _ in range(3):
      f = rng.uniform(0.5, 2.0)
      w = rng.uniform(0.0, f)
      fb = rng.uniform(f + w, 2 * f + w)
      table = schedules.timetable(name, p, m, durations=Durations(f, f + w, w, fb))
      check(table)
      assert len(table.slots) == (p if name == "dualpipe" else p // 2)
      assert _idles(table).max() == pytest.approx((p / 2 - 1) * (fb + (f + w) - 3 * w), abs=1e-9)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("dualpipe", 1), ("dualpipev", 1)])
def test_a_swapped_pair_of_slots_is_caught(name, v):
  """Consecutive slots of equal length swapped (times kept): a forward and the backward of the same micro-batch
  and stage, or a backward and its W, is always caught; and so are most other swaps (two forwards both ready may
  swap harmlessly: the checker finds wrong slots, not other orders)."""
  table = schedules.timetable(
    name,
    4,
    8,
    v,
    Durations(1.0, 1.0, 0.5 if name.startswith("dual") else 0.0, 2.0 if name.startswith("dual") else None),
  )
  check(table)
  swaps = same_op = caught = 0
  for d, slots in enumerate(table.slots):
    for i in range(len(slots) - 1):
      a, b = slots[i], slots[i + 1]
      if a.end - a.start != b.end - b.start or a.ops == b.ops:
        continue  # ops of unequal length swapped fail on their durations, not on dependencies
      swapped = list(slots)
      swapped[i], swapped[i + 1] = dataclasses.replace(a, ops=b.ops), dataclasses.replace(b, ops=a.ops)
      wrong = dataclasses.replace(table, slots=table.slots[:d] + (tuple(swapped),) + table.slots[d + 1 :])
      ours = {(op.micro_batch, op.chunk) for op in a.ops} & {(op.micro_batch, op.chunk) for op in b.ops}
      swaps, same_op = swaps + 1, same_op + bool(ours)
      try:
        check(wrong)
      except ValueError as e:
        assert "before its input" in str(e)
        caught += 1
      else:
        assert not ours, (d, i, a, b)
  assert (same_op > 0 or name == "gpipe") and caught >= 0.7 * swaps, (same_op, caught, swaps)


def test_wrong_orders_are_refused():
  """A backward before its forward deadlocks; an op run twice, or never, fails the check; bad shapes name the field."""
  routes, orders = slot_orders.gpipe(2, 2, 1)
  orders[1] = [orders[1][2]] + orders[1][:2] + orders[1][3:]  # device 1: B0 before F0
  with pytest.raises(ValueError, match="deadlocks"):
    simulate("gpipe", orders, routes, Durations())
  table = schedules.timetable("1f1b", 2, 4)
  last = table.slots[1][-1]
  twice = dataclasses.replace(
    table, slots=(table.slots[0], table.slots[1][:-1] + (dataclasses.replace(last, ops=table.slots[1][-2].ops),))
  )
  with pytest.raises(ValueError, match="twice"):
    check(twice)
  for args, field in [
    (("zb", 4, 8), "schedule"),
    (("1f1b", 1, 8), "stages"),
    (("1f1b", 4, 0), "micro_batches"),
    (("dualpipe", 3, 12), "stages"),
    (("gpipe", 4, 8, 2), "virtual_stages"),
  ]:
    with pytest.raises(ConfigError, match=f"config field {field}="):
      schedules.timetable(*args)
  with pytest.raises(ValueError, match="Durations.w"):
    Durations(1.0, 1.0, 2.0)


def test_bubble_table_program():
  """experiments/pipeline_bubbles.py: every shape a schedule runs has the published bubble; the others say why."""
  from configs import pipeline_bubbles as bubbles_config
  from experiments import pipeline_bubbles

  record = pipeline_bubbles.run(bubbles_config.get_config())
  refused = {(r["schedule"], r["stages"], r["micro_batches"]) for r in record["rows"] if "refused" in r}
  assert refused == {
    ("interleaved", 8, 4),
    ("dualpipe", 4, 4),
    ("dualpipe", 8, 4),
    ("dualpipe", 8, 8),
    ("dualpipev", 8, 4),
  }
  for r in record["rows"]:
    if "refused" in r:
      assert "config field micro_batches=" in r["refused"]
    else:
      assert r["busiest_idle"] == pytest.approx(r["published_idle"], abs=1e-9), r
  assert "| dualpipe | 8 | — | — | 9 (9) · 0.220 |" in pipeline_bubbles.markdown(record)


def test_timetable_figure_draws_every_slot():
  """The picture has a box per slot of every device, each as long as its slot, in its device's row."""
  from moejax.pipeline.timetable import figure

  tables = [schedules.timetable(name, 4, 8) for name in ("1f1b", "dualpipev")]
  fig = figure(tables)
  for ax, table in zip(fig.axes, tables):
    boxes = sorted((round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_width()) for p in ax.patches)
    want = sorted((d, s.start, s.end - s.start) for d, slots in enumerate(table.slots) for s in slots)
    assert boxes == pytest.approx(want)
    assert len(ax.texts) == len(want)
