"""The scaling sweep measured on CPU devices: the default schemes on 1 and 2 nodes x 4 devices, every point also
timed (measure.platform 'cpu') and priced from its own programs, calibrated on the same job.

Sized so that two processes of 4 CPU devices each (gloo, a real 2 x 4 job on one machine) finish on a 2-core
machine in minutes: a small model (d 128, f 256, 2 layers of which 1 MoE, micro batch 4 x 64 tokens, a vocabulary of
2048), weak scaling only, 6 to 10 repeats of a step and 6 to 30 of a layer. It checks the path and the model's
predictions on this machine; its times say nothing about GPUs.

  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.scaling \
      --config=configs/scaling_measured_cpu.py --workdir=/tmp/two_hosts
  python -m experiments.scaling --config=configs/scaling_measured_cpu.py --workdir=/tmp/one_host  # 8 devices
"""

import ml_collections

from configs import scaling_default


def get_config() -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.nodes = (1, 2)
  config.gpus_per_node = (4,)
  config.scalings = ("weak",)  # a measured step compiles for each scaling: strong would double the run
  config.models = ml_collections.ConfigDict(
    {
      "cpu": {
        "d_model": 128,
        "d_ff": 256,
        "layers": 2,
        "moe_layers": 1,
        "seq_len": 64,
        "micro_batch": 4,
        "vocab": 2048,
      },
    }
  )
  # A layer's calls on the 2-process job spread over 2x (gloo carries even a process's own collectives): up to 30
  # of them, each a fraction of a step's.
  config.measure.update(platform="cpu", warmup=2, repeats=6, max_repeats=10, layer_max_repeats=30, spread=0.1)
  config.calibration.source = "measure"
  return config
