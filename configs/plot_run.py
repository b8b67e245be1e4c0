"""A training run's curves (experiments/plot_run.py).

  python -m experiments.plot_run --workdir=/tmp/mlm                               # the run in /tmp/mlm, curves.png there
  python -m experiments.plot_run --config.run=/tmp/mlm --workdir=/tmp/mlm_plots
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.run = ""  # the training workdir whose metrics.jsonl is drawn ('' = --workdir)
  return config
