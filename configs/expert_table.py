"""The expert-backend table of measured kernel records (experiments/expert_table.py): what expert_backend='auto'
reads, written to <workdir>/<device key>.json.

  python -m experiments.expert_table --workdir=moejax/cost/expert_tables \\
      --config.records=OUT_DIR/part1/kernels.json,OUT_DIR/part2/kernels.json
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Kernel records (kernels.json of experiments/bench_kernels.py or of the GPU suite's kernels step), one device
  # kind and dtype, no smoke run; a later record's result replaces an earlier one's for the same shape, pass and
  # implementation.
  config.records = ()
  return config
