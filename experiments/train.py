"""Trains a SMILE language model; resumes from the last complete checkpoint in --workdir.

  python -m experiments.train --config=configs/mlm.py --workdir=/tmp/mlm
  python -m experiments.train --config=configs/mlm.py:3.7b --workdir=... --config.moe.top_k=2
  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- \\
      python -m experiments.train --config=configs/mlm.py --workdir=/tmp/mlm2

Writes config.json (the resolved config with the versions it ran with), metrics.jsonl (with the held-out loss every
log.eval_every steps), TensorBoard events, checkpoints/ and summary.json to the workdir. A workdir holding checkpoints
is resumed only with the same config (steps and the logging, evaluation and checkpoint frequencies may change), else
refused naming the fields; --config.checkpoint.resume=continue trains on with the new config, or
--config.checkpoint.resume=branch --config.checkpoint.branch_dir=DIR continues a copy in DIR (moejax.train.resume).
A workdir holding another program's outputs (an export, a sweep) is refused (moejax.workdir_guard). A step whose loss
or gradient norm is not finite is skipped; train.max_nonfinite_steps of them in a row stop the run with one line
naming the step and the last checkpoint, and exit status 1 (moejax.train.guard).
Without GPUs (or with JAX_PLATFORMS=cpu) the mesh is made of simulated CPU devices.
"""

import logging
import os
import sys

from absl import logging as absl_logging

from moejax import cli
from moejax.data.tokenizer import TokenizerError
from moejax.pipeline import section as pipeline_section
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import guard
from moejax.train import trainer as train
from moejax.validation import ConfigError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "mlm.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Experiment config file.")
_WORKDIR = cli.define_workdir("Directory for checkpoints, metrics and caches.")


class _QuietCheckpointing(logging.Filter):
  """Keeps orbax's per-save progress lines out of the console; its warnings and errors pass."""

  def filter(self, record):
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  del argv
  absl_logging.get_absl_handler().addFilter(_QuietCheckpointing())
  config = _CONFIG.value
  try:
    checked = config_lib.checked(config)  # once per run: the preset applied, every field checked
    if distributed.initialize() == "single":
      mesh_lib.simulate_cpu_devices(pipeline_section.stages(config) * config.mesh.nodes * config.mesh.gpus_per_node)
    train.train(config, _WORKDIR.value, checked)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:  # before training: nothing in flight to wait for
    distributed.exit_with(f"error: {e}")
  except guard.TrainingStopped as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.run(main)
