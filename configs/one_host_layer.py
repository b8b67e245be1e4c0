"""One MoE layer forward on one host's devices (a 1 x gpus_per_node mesh), timed alone or inside a job of several
processes whose other hosts wait (experiments/one_host_layer.py): what the job's collectives implementation (gloo)
costs a program whose devices are all in one process.

python -m experiments.one_host_layer --workdir=/tmp/one_host
python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.one_host_layer \
    --workdir=/tmp/one_host_2p
"""

import ml_collections

from configs import scaling_measured_cpu


def get_config() -> ml_collections.ConfigDict:
  sweep = scaling_measured_cpu.get_config()
  config = ml_collections.ConfigDict()
  config.scheme = "switch"  # a sweep scheme (moejax.study.points.SWEEP_SCHEMES)
  config.gpus_per_node = 4  # the host's devices the layer spans
  config.d_model = sweep.models.cpu.d_model
  config.d_ff = sweep.models.cpu.d_ff
  config.tokens_per_gpu = sweep.models.cpu.micro_batch * sweep.models.cpu.seq_len
  config.moe = sweep.moe  # experts_per_gpu, capacity factors, wire dtypes: the measured sweep's
  config.seed = 0
  config.warmup = 3  # untimed calls after the compiling one
  config.calls = 30  # timed calls
  return config
