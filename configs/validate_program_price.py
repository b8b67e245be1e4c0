"""The compiled layer's price against its measured time on the simulated CPU mesh (experiments/validate_program_price.py):
the terms from microbenchmarks only (moejax.study.program_calibration), every case held out.

python -m experiments.validate_program_price --workdir=/tmp/program_price
python -m experiments.validate_program_price --workdir=/tmp/program_price --config.cases=128:256:4096:node_first:padded
python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.validate_program_price \
    --workdir=/tmp/switch_2p --config.top_k=1 --config.num_experts=8 --config.capacity_factor=2.0 \
    --config.cases=128:256:2048:flat:capacity     # the sweep's switch 2 x 4 point's layer, over two processes
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.nodes = 2  # mesh: nodes x gpus_per_node simulated CPU devices
  config.gpus_per_node = 4
  config.num_experts = 16
  config.top_k = 2
  config.capacity_factor = ml_collections.config_dict.placeholder(
    float
  )  # the capacity collective's (Switch: 2.0 with top_k 1); None: dropless
  # Each case "d_model:d_ff:tokens:path:collective" (tokens: the whole mesh's): a layer timed forward and
  # forward+backward and priced.
  config.cases = (
    "128:256:4096:node_first:padded",
    "256:512:8192:node_first:padded",
    "256:512:8192:flat:padded",
    "512:1024:8192:gpu_first:padded",
  )
  config.per_op = True  # also price each compute op at its own time alone (moejax.study.op_timing)
  config.repeats = 7  # timed calls per measurement (median), after one warm-up call
  return config
