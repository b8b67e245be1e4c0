"""DeepSeek-V3's training step priced from each schedule's timetable on the H800 preset
(experiments/pipeline_cost.py).

  python -m experiments.pipeline_cost                                              # prints the tables
  python -m experiments.pipeline_cost --workdir=benchmarks/results/2026-11-27-cpu  # and pipeline_cost.json
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.topology = "h800_nvlink"  # moejax.cost.topology preset
  config.stages = 16  # DeepSeek-V3 report Sec. 3.2: 16-way pipeline parallelism
  config.micro_batches = (32, 128)  # per step and pipeline (32: DualPipe's least at 16 stages); assumed
  config.tokens = 4096  # tokens per device per micro-batch: one sequence of 4096 (assumed, as docs/memory.md's rows)
  # The exchange's rows per token, measured on the real layer (DeepSeek-V3's routing, 8 x 8 mesh, node_first
  # path with dedup, uniform router), and its wire (FP8 out, BF16 back): experiments/wire_traffic.py's record.
  config.traffic = "benchmarks/results/2026-11-25-cpu/wire_traffic.json"
  return config
