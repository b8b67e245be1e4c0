"""The fast tier's budget (tests/fast_tier.py): pytest's duration report read back, and which tests leave the tier."""

import json
import random

from tests import fast_tier


def test_report_lines_sum_per_test_and_drop_the_xdist_group():
  report = "\n".join(
    [
      "============ slowest durations ============",
      "2.50s call     tests/test_a.py::test_x[1-2]@hf_a",
      "0.50s setup    tests/test_a.py::test_x[1-2]@hf_a",
      "0.25s call     tests/test_b.py::test_y",
      "(12 durations < 0.005s hidden.)",
      "1749 passed in 280.51s (0:04:40)",
    ]
  )
  assert fast_tier.parse_durations(report) == {"tests/test_a.py::test_x[1-2]": 3.0, "tests/test_b.py::test_y": 0.25}


def test_over_the_limit_leave_the_tier_but_each_module_keeps_its_cheapest():
  rng = random.Random(0)
  durations = {f"tests/test_{m}.py::test_{i}": rng.uniform(0.0, 4.0) for m in "abc" for i in range(20)}
  durations["tests/test_only_slow.py::test_one"] = 9.0
  slow = fast_tier.slow_by_duration(durations, limit_s=1.0)
  for test_id, seconds in durations.items():
    module = test_id.split("::")[0]
    cheapest = min(s for t, s in durations.items() if t.startswith(module + "::"))
    assert (test_id in slow) == (seconds >= 1.0 and seconds != cheapest), test_id
  assert "tests/test_only_slow.py::test_one" not in slow


def test_writing_keeps_the_entries_the_report_lacks(tmp_path):
  """A fast-subset report lacks the tests the file marked slow (they did not run): their entries stay, so they stay
  slow; the report's tests take its times."""
  out, report = tmp_path / "durations.json", tmp_path / "report.txt"
  out.write_text('{"tests/test_a.py::test_slow": 5.0, "tests/test_a.py::test_x": 0.1}\n')
  report.write_text("0.30s call     tests/test_a.py::test_x\n2.00s call     tests/test_b.py::test_new@g\n")
  fast_tier.main(["fast_tier", str(report), str(out)])
  assert json.loads(out.read_text()) == {
    "tests/test_a.py::test_slow": 5.0,
    "tests/test_a.py::test_x": 0.3,
    "tests/test_b.py::test_new": 2.0,
  }
