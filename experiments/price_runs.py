"""Several runs of a measured sweep (each point priced from its own timed programs, `measure.price_program`) side
by side: every point's measured and priced layer forward and training step with the error in each run, then per run
the median |error|, the range and how many are within the bound, and whether the bound holds in every run, then each
layer's time in collectives and in compute, profiled and priced (`moejax.study.price_runs`). Writes price_runs.json to --workdir.

  python -m experiments.price_runs --config.sweeps=/tmp/run1,/tmp/run2,/tmp/run3 --workdir=/tmp/price_runs
"""

import os

from moejax import cli, workdir_guard
from moejax.study import price_runs
from moejax.validation import require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "price_runs.py")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  require(
    config.sweeps, "sweeps", config.sweeps, "sweep workdirs separated by commas, e.g. --config.sweeps=/tmp/a,/tmp/b"
  )
  labels = config.labels or [os.path.basename(os.path.normpath(s)) for s in config.sweeps]
  require(len(labels) == len(config.sweeps), "labels", config.labels, f"one label per sweep ({len(config.sweeps)})")
  require(len(set(labels)) == len(labels), "labels", labels, "distinct (pass --config.labels)")
  require(0 < config.median <= config.each, "median", config.median, f"in (0, each = {config.each}]")
  runs = {label: price_runs.load(sweep) for label, sweep in zip(labels, config.sweeps)}
  print(price_runs.points_table(runs))
  print()
  print(price_runs.summary_table(runs, config.each, config.median))
  print("\nthe layer's split, profiled against priced:\n")
  print(price_runs.split_table(runs))
  workdir_guard.claim(workdir, "experiments.price_runs", beside=config.sweeps)
  cli.write_json(workdir, "price_runs.json", price_runs.record(runs, config.each, config.median))


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/price_runs.py).")
  _WORKDIR = cli.define_workdir("Directory for price_runs.json.")
  cli.run(main)
