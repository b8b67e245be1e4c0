"""The routers' convergence study's table and plots redrawn from its results.json (experiments/convergence_report.py).

  python -m experiments.convergence_report --workdir=/tmp/convergence
  python -m experiments.convergence_report --config.results=benchmarks/results/2026-11-23-cpu/convergence.json \\
      --workdir=docs/convergence
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.results = ""  # a study's results.json ('' = <workdir>/results.json)
  return config
