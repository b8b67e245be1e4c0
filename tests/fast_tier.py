"""The fast tier's time budget: which tests `-m 'not slow'` leaves for the whole suite, from measured durations.

`tests/durations.json` holds each test's seconds (setup, call and teardown) from a fast-subset run with a cold
compilation cache on a 2-core machine. A test recorded at FAST_LIMIT_S or more is marked slow, except the cheapest
recorded test of its module, so every module keeps at least one test in the daily loop. Nothing is skipped: the
whole suite runs every test, and a test not in the file (a new one) stays fast until the file is written again:

  python -m pytest -n 2 -m 'not slow' tests -p no:cacheprovider --durations=0 > durations.txt
  python -m tests.fast_tier durations.txt tests/durations.json

Writing keeps the file's other entries: the tests it marked slow do not run in the fast subset, so a new report
lacks them, and dropping them would bring them back into the tier.
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

FAST_LIMIT_S = 1.0
DURATIONS = Path(__file__).with_name("durations.json")
# One line of pytest's `--durations` report: "1.23s call     tests/test_x.py::test_y[case]@group".
_LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)$")


def parse_durations(report: str) -> dict[str, float]:
  """Seconds per test id from pytest's `--durations=0` report; xdist's `@group` suffix is not part of the id."""
  seconds = defaultdict(float)
  for line in report.splitlines():
    match = _LINE.match(line.strip())
    if match:
      seconds[match.group(2).split("@", 1)[0]] += float(match.group(1))
  return dict(seconds)


def slow_by_duration(durations: dict[str, float], limit_s: float = FAST_LIMIT_S) -> set[str]:
  """The test ids to mark slow: recorded at `limit_s` or more and not their module's cheapest recorded test."""
  cheapest = {}
  for test_id, seconds in durations.items():
    module = test_id.split("::", 1)[0]
    if module not in cheapest or seconds < durations[cheapest[module]]:
      cheapest[module] = test_id
  keep = set(cheapest.values())
  return {test_id for test_id, seconds in durations.items() if seconds >= limit_s and test_id not in keep}


def mark_over_budget_slow(items, path: Path = DURATIONS) -> None:
  """Marks slow the collected tests `slow_by_duration` names (none if the file is missing)."""
  if not path.exists():
    return
  slow = slow_by_duration(json.loads(path.read_text()))
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)


def main(argv: list[str]) -> None:
  if len(argv) != 3:
    raise SystemExit(f"usage: python -m tests.fast_tier DURATIONS_REPORT OUT_JSON (got {argv[1:]})")
  reported = parse_durations(Path(argv[1]).read_text())
  if not reported:
    raise SystemExit(f"{argv[1]}: no `--durations` lines (run pytest with --durations=0)")
  out = Path(argv[2])
  seconds = {**(json.loads(out.read_text()) if out.exists() else {}), **reported}  # the report's times replace
  out.write_text(json.dumps({k: round(v, 2) for k, v in sorted(seconds.items())}, indent=1) + "\n")
  slow = slow_by_duration(seconds)
  kept = sum(v for k, v in seconds.items() if k not in slow)
  print(f"{len(seconds)} tests recorded, {len(slow)} over {FAST_LIMIT_S} s move to the slow tier; {kept:.0f} s stay")


if __name__ == "__main__":
  main(sys.argv)
