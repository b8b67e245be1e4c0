"""Lina's popularity-based expert replication replayed on routing traces (experiments/lina_replication.py).

  python -m experiments.lina_replication --workdir=/tmp/lina                          # synthetic traces
  python -m experiments.lina_replication --workdir=/tmp/lina --config.traces=/path/traces.npy --config.nodes=4 \\
      --config.gpus_per_node=4

Lina: Li et al., "Accelerating Distributed MoE Training and Inference with Lina", USENIX ATC'23.
"""

import ml_collections


def _optional_int():
  """An int field that may be None (untyped: `--config.field=16` and `=None` are read as Python literals)."""
  return ml_collections.FieldReference(None, field_type=object)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.traces = ""  # path of a .npy int array [L, T(, K)] of expert ids; '' = synthetic
  config.num_experts = _optional_int()  # experts per layer (None: 16 synthetic, else the traces' max id + 1)
  config.nodes = 4  # nodes (Lina Sec. 7.1: 4)
  config.gpus_per_node = 4  # GPUs per node (Lina Sec. 7.1: 4)
  config.slots_per_device = 2  # expert slots per GPU (Lina Sec. 7.1 packs at most 4)
  config.profile_fraction = 0.5  # leading fraction of the tokens profiled
  config.batch_tokens = 16384  # tokens per inference batch (assumed, 1024 per GPU of 16; Lina does not state it)
  config.path_length = 3  # path length l (Lina Sec. 7.1: 3)
  config.top_k = _optional_int()  # experts kept per path (None: K, Lina's rule; E keeps the whole distribution)
  config.window = 4  # batches averaged by the moving-average baseline
  config.topology = "a100_ib100"  # cost-model topology preset (Lina's testbed)
  config.d_model = 1024  # hidden size: BERT-Large's 1024 (Devlin et al. 2019, Sec. 3)
  config.d_ff = 4096  # expert FFN size: BERT-Large's 4 x 1024
  config.bytes_per_element = 2  # bytes per activation element (assumed fp16)
  config.check_ms = 1.45  # phase-2 check without re-plan (Lina Sec. 7.3.1: 1.45 ms)
  config.replan_ms = 6.2  # phase-2 re-plan (Lina Sec. 7.3.1: about 6.2 ms)
  # The synthetic traces, without `traces`.
  config.synthetic = ml_collections.ConfigDict(
    {
      "layers": 12,  # MoE layers (Lina's inference models have 12)
      "tokens": 524288,
      "choices": 1,  # experts per token (Lina Sec. 7.1: top-1 in inference)
      "noise": 0.5,  # probability a choice ignores the token's type
      "seed": 0,
    }
  )
  return config
