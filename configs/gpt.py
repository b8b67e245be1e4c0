"""The GPT-style causal decoder with the same MoE blocks, sizes and data as configs/mlm.py.

python -m experiments.train --config=configs/gpt.py --workdir=/tmp/gpt        # tiny
python -m experiments.train --config=configs/gpt.py:13b --workdir=...
"""

import ml_collections

from configs import mlm


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  config = mlm.get_config(size)
  config.model.kind = "gpt"
  return config
