"""The cost models against papers' numbers, one section per paper (experiments/validate_cost_model.py).

python -m experiments.validate_cost_model --workdir=/tmp/validation
python -m experiments.validate_cost_model --workdir=/tmp/validation --config.sections=parm
"""

import ml_collections

from moejax.study.papers import comet


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.sections = ("smile", "comet", "parm", "lina")  # papers to check: smile, comet, parm, lina
  # Benchmark JSON whose measured TFLOP/s prices the H800's expert GEMMs ('' = datasheet peak x efficiency; default:
  # the repository's H100 results).
  config.comet_rate_json = str(comet.RATE_JSON)
  return config
