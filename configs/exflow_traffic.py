"""ExFlow's exchange traffic on simulated meshes, measured by decoding with configs/generate.py's trained GPT-MoE
(experiments/exflow_traffic.py).

  python -m experiments.exflow_traffic --workdir=/tmp/exflow                          # trains first (minutes)
  python -m experiments.exflow_traffic --workdir=/tmp/exflow --config.train_dir=/tmp/gen/train \\
      --config.traffic.meshes=2x4,2x8
"""

import ml_collections

from configs import generate


def get_config() -> ml_collections.ConfigDict:
  config = generate.trained_model()
  config.traffic = ml_collections.ConfigDict(
    {
      "meshes": ("1x4", "2x4", "4x2", "2x8"),  # meshes as NODESxGPUS
      "profile_tokens": 8192,  # tokens traced to solve the placement on
      "batch": 32,  # requests decoded per mesh (a multiple of every mesh's devices)
      "prompt_len": 16,  # prompt tokens per request
      "steps": 24,  # tokens generated per request
      "time_limit_s": 20.0,  # HiGHS time limit per placement stage
      "topology": "dgx_h100_ib",  # topology preset the decode steps are priced on
      "price_d_model": 0,  # model width the rows are priced at (0: the model's own)
    }
  )
  return config
