"""Records the routing traces of a trained language model on its corpus, for experiments.lina_replication.

  python -m experiments.record_traces --workdir=/tmp/mlm --config.tokens=65536 --config.model.num_layers=10 \\
      --config.model.moe_every=1 --config.moe.num_experts=16
  python -m experiments.lina_replication --workdir=/tmp/mlm/lina --config.traces=/tmp/mlm/traces.npy \\
      --config.num_experts=16

configs/record_traces.py holds the model's config (configs/mlm.py's by default; `:gpt`, `:decoder:qwen3_moe`, ...),
the training run to load (config.train_dir; without it the config is trained into <workdir>/train first for
config.steps, unless that holds a checkpoint: `moejax.train.trained`) and the tokens to trace. The traced tokens are
the first config.tokens of the training data stream (the corpus from its beginning, in the batches training reads),
run without dropout or jitter. A BERT model sees them unmasked, as inference on whole sequences does (no [MASK]
tokens). Saves int32 [L, T, K] (`moejax.placement.traces.routing_traces`: MoE layer, token in batch order, choice)
with np.save to <workdir>/traces.npy, and a JSON summary (step, shape, per-layer expert loads) next to it.
"""

import json
import os
import sys

import numpy as np

from moejax import cli, workdir_guard
from moejax.data import corpus as data_lib
from moejax.data import pipeline as pipeline_lib
from moejax.data.tokenizer import TokenizerError
from moejax.infer import load
from moejax.placement.traces import routing_traces
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.train import trained
from moejax.validation import ConfigError, is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "record_traces.py")
TRACES_FILE = "traces.npy"


def corpus_batches(config, tok, cache_dir: str, tokens: int) -> list[np.ndarray]:
  """The first batches [B, S] of the training data stream covering `tokens` (B: the config's micro-batch rows)."""
  rows = config.batch_size // config.micro_batches
  batches = pipeline_lib.Batches(
    data_lib.corpus_files(config.data.train_files, cache_dir),
    tok,
    seq_len=config.seq_len,
    rows=rows,
    micro_batches=1,
    num_shards=config.data.shards,
    prefetch=0,
  )
  try:
    return [next(batches)[0] for _ in range(-(-tokens // (rows * config.seq_len)))]
  finally:
    batches.close()


def record(config, workdir: str) -> tuple[np.ndarray, dict]:
  """(traces int32 [L, config.tokens, K], summary) of the model `trained.trained_model` gives (trained first into
  <workdir>/train without config.train_dir)."""
  require(is_int(config.tokens), "tokens", config.tokens, "a positive number of tokens to trace")
  model, tok, step = trained.trained_model(config, workdir)
  checkpoint = trained.run_dir(config, workdir)
  print(f"loaded step {step} from {checkpoint}; tracing {config.tokens} tokens", flush=True)
  batches = corpus_batches(config, tok, load.cache_dir(config, checkpoint), config.tokens)
  traces = routing_traces(model, batches)[:, : config.tokens]
  loads_MxE = np.stack([np.bincount(layer.reshape(-1), minlength=config.moe.num_experts) for layer in traces])
  summary = {
    "checkpoint": checkpoint,
    "step": int(step),
    "kind": config.model.kind,
    "inputs": "unmasked corpus",
    "shape": list(traces.shape),
    "num_experts": config.moe.num_experts,
    "top_k": config.moe.top_k,
    "busiest_over_mean": (loads_MxE.max(axis=1) / loads_MxE.mean(axis=1)).round(3).tolist(),
    "expert_loads": loads_MxE.tolist(),
  }
  return traces, summary


def run(config, workdir: str) -> str:
  """Records the traces and writes them to <workdir>/traces.npy (the summary to traces.npy.json); returns the
  path. The mesh's devices must exist (`simulate_cpu_devices` without GPUs)."""
  traces, summary = record(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, TRACES_FILE)
  np.save(path, traces)
  with open(path + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  print(
    f"saved traces {traces.shape} to {path}; busiest expert over the mean per layer: {summary['busiest_over_mean']}",
    flush=True,
  )
  return path


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    # Its file may go beside those of the run it loads (config.train_dir), else into a workdir of its own.
    workdir_guard.claim(
      _WORKDIR.value, "experiments.record_traces", beside=[config.train_dir] if config.train_dir else []
    )
    if distributed.initialize() == "single":
      mesh_lib.simulate_cpu_devices(config.mesh.nodes * config.mesh.gpus_per_node)
    run(config, _WORKDIR.value)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Model and tracing config file (configs/record_traces.py).")
  _WORKDIR = cli.define_workdir("Directory for traces.npy (and the training run without config.train_dir).")
  cli.run(main)
