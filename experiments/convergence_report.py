"""Redraws the routers' convergence study's table and plots from its results.json, without training
(`moejax.study.convergence.redraw`).

  python -m experiments.convergence_report --workdir=/tmp/convergence          # the study's own results.json
  python -m experiments.convergence_report --config.results=benchmarks/results/2026-11-23-cpu/convergence.json \\
      --workdir=docs/convergence

Writes table.md, loss.png and busiest_load.png to --workdir.
"""

import os

from moejax import cli, workdir_guard
from moejax.study import convergence as report
from moejax.validation import require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "convergence_report.py")


def main(argv):
  del argv
  workdir = _WORKDIR.value
  results = _CONFIG.value.results or os.path.join(workdir, "results.json")
  require(os.path.isfile(results), "results", results, "a convergence study's results.json ('' = the one in --workdir)")
  if _CONFIG.value.results:  # the report of results from elsewhere: a workdir of its own
    workdir_guard.claim(workdir, "experiments.convergence_report")
  else:  # the study's own table and plots redrawn in its workdir, as the study writes them
    workdir_guard.check(workdir, "experiments.convergence")
  print("wrote", ", ".join(report.redraw(results, workdir)))


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/convergence_report.py).")
  _WORKDIR = cli.define_workdir("Directory for table.md, loss.png and busiest_load.png.")
  cli.run(main)
