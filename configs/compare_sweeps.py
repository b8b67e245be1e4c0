"""Several sweep workdirs' scaling curves in one plot and one table (experiments/compare_sweeps.py).

  python -m experiments.compare_sweeps --config.sweeps=/tmp/sweep_h100,/tmp/sweep_p4d --workdir=/tmp/compare
  python -m experiments.compare_sweeps --config.sweeps=a,b --config.labels="DGX H100,P4d EFA" \\
      --config.metric=layer_ms --workdir=/tmp/compare
  python -m experiments.compare_sweeps --config.sweeps=a,b --config.schemes=switch,smile --config.scalings=weak \\
      --workdir=/tmp/weak
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.sweeps = ()  # sweep workdirs (each with results.json or results.csv)
  config.labels = ()  # one label per sweep (default: the directory names)
  config.metric = "samples_per_s"  # row field to draw: samples_per_s, layer_ms, step_s, ...
  config.schemes = ()  # only these schemes, e.g. switch,smile (default: all)
  config.scalings = ()  # only these scalings: weak, strong (default: both)
  config.models = ()  # only these models of the sweeps' configs (default: all)
  return config
