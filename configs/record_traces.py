"""Routing traces of a trained language model on its corpus (experiments/record_traces.py), for
experiments/lina_replication.py.

  python -m experiments.record_traces --workdir=/tmp/mlm --config.tokens=65536 --config.model.num_layers=10 \\
      --config.model.moe_every=1 --config.moe.num_experts=16                   # configs/mlm.py's model
  python -m experiments.record_traces --config=configs/record_traces.py:gpt --workdir=/tmp/gpt
  python -m experiments.record_traces --config=configs/record_traces.py:decoder:qwen3_moe --workdir=/tmp/qwen3

The argument names the training config of the model (configs/training.py: a config file of configs/ and its own
argument after a colon; default mlm: configs/mlm.py). Its fields are the model's; `train_dir` names the training run to load ('' = trained
into <workdir>/train first, unless it holds a checkpoint).
"""

import ml_collections

from configs import training


def get_config(model: str = "mlm") -> ml_collections.ConfigDict:
  config = training.load(model)
  config.train_dir = ""  # a training workdir (experiments.train's --workdir) to load; '' = <workdir>/train
  config.tokens = 65536  # tokens to trace (the last batch is cut to this count)
  return config
