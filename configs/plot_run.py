"""Training runs' curves, several runs overlaid (experiments/plot_run.py).

python -m experiments.plot_run --workdir=/tmp/mlm                               # the run in /tmp/mlm, curves.png there
python -m experiments.plot_run --config.runs=/tmp/a,/tmp/b --workdir=/tmp/a_vs_b
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.runs = ()  # the training workdirs whose metrics.jsonl are drawn (none: --workdir)
  return config
