"""Runs of a measured sweep against the timed programs' prices and the bound (experiments/price_runs.py).

python -m experiments.price_runs --config.sweeps=/tmp/run1,/tmp/run2,/tmp/run3 --workdir=/tmp/price_runs
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.sweeps = ()  # sweep workdirs of measured, program-priced points (configs/scaling_measured_cpu.py's)
  config.labels = ()  # one label per sweep (default: the directory names)
  config.each = 0.25  # every point's |priced / measured - 1| within this
  config.median = 0.10  # and their median within this, per run and quantity
  return config
