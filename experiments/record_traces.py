"""Records the routing traces of a trained language model on its corpus, for experiments.lina_replication.

  python -m experiments.record_traces --config=configs/mlm.py --checkpoint=/tmp/mlm --tokens=65536 \\
      --out=/tmp/mlm/traces.npy --config.model.num_layers=10 --config.model.moe_every=1 --config.moe.num_experts=16
  python -m experiments.lina_replication --traces=/tmp/mlm/traces.npy --num_experts=16 --workdir=/tmp/mlm/lina

--checkpoint is a training workdir (experiments.train's --workdir); when it holds no checkpoint the config
is trained there for --config.steps first. The traced tokens are the first --tokens of the training data
stream (the corpus from its beginning, in the batches training reads), run without dropout or jitter. A
BERT model sees them unmasked, as inference on whole sequences does (no [MASK] tokens). Saves int32
[L, T, K] (`moejax.placement.traces.routing_traces`: MoE layer, token in batch order, choice) with np.save
to --out, and a JSON summary (step, shape, per-layer expert loads) next to it.
"""

import json
import os
import sys

import numpy as np
from absl import flags

from moejax.cli import define_config, run
from moejax.data import corpus as data_lib
from moejax.data.tokenizer import TokenizerError
from moejax.infer import load
from moejax.placement.traces import routing_traces
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.train import trainer as trainer_lib
from moejax.validation import ConfigError, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "mlm.py")
_CONFIG = define_config(_DEFAULT_CONFIG, "Model and training config file.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Training workdir to load (trained there first when it holds "
                                  "no checkpoint); default: the directory of --out, subdirectory train.")
_TOKENS = flags.DEFINE_integer("tokens", 65536, "Tokens to trace (the last batch is cut to this count).")
_OUT = flags.DEFINE_string("out", None, "Path of the .npy traces [L, T, K]; the summary goes to PATH.json.",
                           required=True)


def corpus_batches(config, tok, cache_dir: str, tokens: int) -> list[np.ndarray]:
  """The first batches [B, S] of the training data stream covering `tokens` (B: the config's micro-batch rows)."""
  rows = config.batch_size // config.micro_batches
  batches = data_lib.Batches(data_lib.corpus_files(config.data.train_files, cache_dir), tok, seq_len=config.seq_len,
                             rows=rows, micro_batches=1, num_shards=config.data.shards, prefetch=0)
  try:
    return [next(batches)[0] for _ in range(-(-tokens // (rows * config.seq_len)))]
  finally:
    batches.close()


def record(config, checkpoint: str, tokens: int) -> tuple[np.ndarray, dict]:
  """(traces int32 [L, tokens, K], summary) of the model trained in `checkpoint` (trained first if missing)."""
  require(isinstance(tokens, int) and tokens > 0, "tokens", tokens, "a positive number of tokens to trace")
  trainer_lib.train_unless_checkpointed(config, checkpoint)
  model, tok, step = load.load_trained(config, checkpoint)
  print(f"loaded step {step} from {checkpoint}; tracing {tokens} tokens", flush=True)
  batches = corpus_batches(config, tok, load.cache_dir(config, checkpoint), tokens)
  traces = routing_traces(model, batches)[:, :tokens]
  loads_MxE = np.stack([np.bincount(layer.reshape(-1), minlength=config.moe.num_experts) for layer in traces])
  summary = {"checkpoint": checkpoint, "step": int(step), "kind": config.model.kind, "inputs": "unmasked corpus",
             "shape": list(traces.shape), "num_experts": config.moe.num_experts, "top_k": config.moe.top_k,
             "busiest_over_mean": (loads_MxE.max(axis=1) / loads_MxE.mean(axis=1)).round(3).tolist(),
             "expert_loads": loads_MxE.tolist()}
  return traces, summary


def main(argv):
  del argv
  config = _CONFIG.value
  checkpoint = _CHECKPOINT.value or os.path.join(os.path.dirname(os.path.abspath(_OUT.value)), "train")
  try:
    if distributed.initialize() == "single":
      mesh_lib.simulate_cpu_devices(config.mesh.nodes * config.mesh.gpus_per_node)
    traces, summary = record(config, checkpoint, _TOKENS.value)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:
    sys.exit(f"error: {e}")
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  np.save(_OUT.value, traces)
  with open(_OUT.value + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  print(f"saved traces {traces.shape} to {_OUT.value}; busiest expert over the mean per layer: "
        f"{summary['busiest_over_mean']}", flush=True)


if __name__ == "__main__":
  run(main)
