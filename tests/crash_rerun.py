"""A pytest plugin (tests/conftest.py imports its hooks): a test whose xdist worker dies is run once more.

XLA's CPU compiler segfaults on rare occasions in a cold run (seen in a compile and in a compiled program's
serialisation for the persistent cache, in a different test each time, never twice on one test), and the worker dies
with its test. xdist's loadgroup scheduler queues the dead worker's unfinished group again on a fresh worker
(--max-worker-restart in pyproject.toml), so the first crash of a test is reported as a rerun (`R` in the progress
line, a line naming it in the summary); a second crash of the same test fails it and stops the run.
"""

import pytest

_CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  if crashitem not in _CRASHED:
    _CRASHED.add(crashitem)
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}; queued again on a fresh worker"
    _drop_finished_units(sched)
    return
  # A second crash fails the test and stops the run as a failure at --maxfail would: loadgroup would otherwise queue it
  # again on fresh workers until the restarts run out.
  report.node.config.pluginmanager.getplugin("dsession").shouldstop = f"{crashitem} crashed its worker twice"


def pytest_report_teststatus(report):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter):
  for report in terminalreporter.stats.get("rerun", []):
    terminalreporter.write_line(f"RERUN {report.longrepr}", yellow=True)


def pytest_sessionfinish(session, exitstatus):
  """A run that xdist stopped early (its workers' restarts used up: `maximum crashed workers reached`) fails: its
  summary counted only the tests that ran (a CI run passed with 134 of the end-to-end tier's 349 never run)."""
  dsession = session.config.pluginmanager.getplugin("dsession")
  # xdist keeps the restarts' end in `_summary_report` (no public field), a stop at a second crash in `shouldstop`
  stopped = getattr(dsession, "_summary_report", None) or getattr(dsession, "shouldstop", None)
  if stopped and exitstatus == pytest.ExitCode.OK:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.get_terminal_writer().line(f"the run stopped early: {stopped}", red=True, bold=True)


def _drop_finished_units(sched) -> None:
  """loadgroup queues every unit the dead worker was ever given, finished ones too; one of those handed to a worker
  that waits for its next test sends it nothing, and that worker then waits for good (a whole-suite run hung so at
  98%). The finished units leave the queue, and each live worker is offered work again."""
  queue, assigned = getattr(sched, "workqueue", None), getattr(sched, "assigned_work", None)
  if queue is None or assigned is None or not hasattr(sched, "_reschedule"):
    return
  for scope in [scope for scope, unit in queue.items() if all(unit.values())]:
    del queue[scope]
  for node in list(assigned):
    sched._reschedule(node)
