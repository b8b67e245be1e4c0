"""The fidelity table: every headline figure of the five papers against the cost model (experiments/fidelity.py).

python -m experiments.fidelity --workdir=/tmp/fidelity
python -m experiments.fidelity --workdir=/tmp/fidelity --config.papers=SMILE,Lina
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.papers = ("SMILE", "Comet", "Parm", "Lina", "ExFlow")  # papers (moejax.study.papers) whose figures to list
  return config
