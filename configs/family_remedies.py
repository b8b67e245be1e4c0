"""The communication remedies on one decoder family (experiments/family_remedies.py).

  python -m experiments.family_remedies --workdir=/tmp/family_remedies                    # qwen3_moe fixture (~2 min)
  python -m experiments.family_remedies --config.family=deepseek_v3 --workdir=/tmp/ds3_remedies
  python -m experiments.family_remedies --config.checkpoint=/path/to/hf_dir --config.schemes=flat,node_first
  python -m experiments.family_remedies --config.extra_schemes='{"s2_dedup": {"esp_schedule": "s2", "dedup": true}}'

Each scheme is a scheme of the one table (moejax.study.schemes: names joined by '+', '_nodedup' for a row per
token-choice) on the checkpoint's own routing; the first, BASELINE, is always run and every other is compared with it.
"""

import ml_collections

# The flat exchange with a row per token-choice (the baseline); dedup on each path; FP8 dispatch (the combine's
# default back, or BF16); the overlap schedules; Parm's expert sharding; replicas (one spare slot per device); expert
# data parallelism; and 'ragged' (refused where XLA has no ragged all-to-all, e.g. on CPU).
BASELINE = "flat_nodedup"
SCHEMES = (
  BASELINE,
  "flat",
  "gpu_first_nodedup",
  "gpu_first",
  "node_first_nodedup",
  "node_first",
  "node_first+fp8",
  "node_first+fp8_bf16",
  "flat+chunked",
  "flat+comet",
  "flat+s1",
  "flat+s2",
  "flat+replicas",
  "flat+expert_data_parallel",
  "ragged",
)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # a local Hugging Face checkpoint directory ('' = the fixture of `family`)
  config.family = "qwen3_moe"  # the fixture under tests/data/hf to load when checkpoint is ''
  config.schemes = SCHEMES  # schemes of moejax.study.schemes (BASELINE, the baseline, always first)
  config.extra_schemes = ""  # a JSON object {NAME: {MoEConfig field: value}}: schemes of your own
  config.num_chunks = 2  # chunks of the 'chunked' and 'comet' schedules
  config.batch = 16  # rows of tokens (the reference's first; a multiple of the devices)
  config.seq_len = 16  # tokens per row without a reference.npz
  config.iters = 20  # timed forward calls per scheme (rounds over the schemes)
  config.seed = 0  # seed of the random token rows
  config.nodes = 2  # mesh nodes
  config.gpus_per_node = 4  # mesh GPUs per node
  return config
