"""Generation with the GPT-style MoE decoder (experiments/generate.py; its model also experiments/exflow_traffic.py's).

  python -m experiments.generate --workdir=/tmp/gen                                # trains briefly first
  python -m experiments.generate --workdir=/tmp/gen --config.train_dir=/tmp/gpt

The training fields (`trained_model`) are configs/gpt.py's tiny model with six blocks (every other FFN an MoE layer, as
in ExFlow's GPT-M 350M MoE-32 with 12 MoE layers in 24, §V-A Table II and Fig. 2: three MoE layers, two
expert-to-expert transitions), 16 experts (one per device on a 2 x 8 mesh), top-1 dropless routing
(context-coherent decoding runs one expert per token; ExFlow's inference uses top-1 gating, §V-A) and short sequences.
`train_dir` names the training run to load ('' = trained into <workdir>/train first, unless it holds a checkpoint);
`generate` holds the decoding request.
"""

import ml_collections

from configs import gpt


def trained_model() -> ml_collections.ConfigDict:
  """The model's training fields, and train_dir: where the model comes from."""
  config = gpt.get_config("tiny")
  config.steps = 300
  config.seq_len = 64
  config.model.update(num_layers=6, max_len=64)
  config.moe.update(num_experts=16, top_k=1, capacity_factor=None)  # dropless
  config.checkpoint.update(every_steps=100, use_async=False)
  config.log.update(tensorboard=False)
  config.train_dir = ""  # a training workdir (experiments.train's --workdir) to load; '' = <workdir>/train
  return config


def get_config() -> ml_collections.ConfigDict:
  config = trained_model()
  config.generate = ml_collections.ConfigDict(
    {
      "mode": "exflow",  # 'vanilla' | 'exflow'
      "batch": 16,  # requests, a multiple of the mesh's devices
      "prompt_len": 16,  # tokens of each prompt (the first tokens of corpus documents)
      "steps": 32,  # tokens generated per request
      "temperature": 0.0,  # 0: greedy
      "seed": 0,
    }
  )
  return config
