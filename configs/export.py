"""A training run's parameters as a Hugging Face checkpoint (experiments/export.py).

python -m experiments.export --config=configs/export.py --config.run=/tmp/q --workdir=/tmp/q_hf
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.run = ""  # the training workdir (its config.json and checkpoints/) whose newest checkpoint is written
  return config
