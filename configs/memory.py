"""The memory planner (experiments/memory.py): per-device bytes of training configs, compiled and counted.

  python -m experiments.memory --workdir=/tmp/memory                            # every row of its PRESETS
  python -m experiments.memory --config.presets=qwen3_moe,mixtral --workdir=/tmp/memory
  python -m experiments.memory --config=configs/memory.py:decoder:deepseek_v3,published --config.model.fsdp=True
  python -m experiments.memory --config.presets=pipelined                        # DeepSeek-V3 pipelined, analytic
  python -m experiments.memory --config=configs/memory.py:decoder:qwen3_moe --config.planner.whole=True \\
      --config.planner.device_gb=0.01

The argument: 'presets' (default: the planner's rows, `presets` picks them: 'all', 'pipelined' or names of
experiments/memory.py's PRESETS and PIPELINED), or a training config (configs/training.py: a config file of configs/ and its own argument after a colon),
planned as one row named 'config', its fields overridable.
"""

import ml_collections

from configs import training
from moejax.train import objective


def get_config(model: str = "presets") -> ml_collections.ConfigDict:
  if model == "presets":
    config = ml_collections.ConfigDict()
    config.presets = ("all",)  # rows to plan: 'all', 'pipelined' or names of PRESETS and PIPELINED
  else:
    config = training.load(model)
    # The loss's vocabulary columns per chunk (moejax.train.objective; 0: unchunked), listed so it can be overridden.
    config.loss_chunk = config.get("loss_chunk", objective.LOSS_CHUNK)
  config.planner = ml_collections.ConfigDict(
    {
      "device_gb": 80.0,  # device memory in GB (10^9 bytes) for the verdict
      "whole": False,  # compile the whole model instead of scaling block variants (a scanned model always is)
      "explain": False,  # list the largest buffers live at the compiled peak (first variant)
      # A pipeline to plan the training config under (analytic only; its mesh is then one stage's, its
      # micro_batches go through the stages): moejax.pipeline.schedules' schedule, or 'none'.
      "schedule": "none",
      "stages": 1,
      "virtual_stages": 1,  # chunks a device with 'interleaved'
    }
  )
  return config
