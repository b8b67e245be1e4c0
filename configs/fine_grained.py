"""Fine-grained experts: the layer forward from E = 8 to 256 at equal active parameters (experiments/fine_grained.py).

python -m experiments.fine_grained --workdir=/tmp/fine_grained
python -m experiments.fine_grained --workdir=/tmp/fine_grained --config.experts=8,64 --config.repeats=3
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.experts = (8, 16, 32, 64, 128, 256)  # numbers of experts E
  config.tokens_per_device = 256  # tokens each of the 8 devices routes
  config.d_model = 64  # model width d
  config.active_hidden = 512  # k x f: hidden units each token runs through
  config.repeats = 5  # timed repetitions (median)
  config.collective = "padded"  # moe.collective of every point (one flat hop)
  return config
