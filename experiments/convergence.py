"""The routers' convergence study: one small GPT-MoE (and the BERT-MoE) trained on the embedded corpus with
Switch, GShard, SMILE (bi-level), node-limited and DeepSeek-V3 routing, at equal active parameters and
steps, over several seeds, on a 2 x 4 mesh of simulated CPU devices.

  python -m experiments.convergence --workdir=/tmp/convergence              # configs/convergence.py
  python -m experiments.convergence --workdir=/tmp/convergence_quick --config=configs/convergence.py:quick  # tiny
  python -m experiments.convergence --workdir=/tmp/c --config.models=gpt --config.seeds=0

Each router x model x seed trains (dropless) in <workdir>/runs/<model>/<router>/seed<s>; a run with a
summary.json is finished and re-used, so an interrupted study resumes. From each run:
  - the per-step train loss (task loss, without the auxiliary losses);
  - the held-out loss of the final checkpoint on documents of the corpus that no run trains on (the
    study splits the embedded corpus into data/train.jsonl and data/heldout.jsonl);
  - per step, the busiest expert's load over the mean load (averaged over the MoE layers);
  - per step, the share of token-choices a capacity factor of config.capacity (1.25) would drop: the
    runs are dropless, and each expert's share of the step's token-choices above capacity / E is counted
    as dropped (over the whole step's tokens: a lower bound of what per-device capacity drops).
Writes results.json, table.md, loss.png and busiest_load.png (`moejax.study.convergence`) to the workdir and prints
the table. Compiled
programs are cached in <workdir>/cache/xla (JAX's persistent compilation cache): every seed after a router's
first loads its programs instead of compiling them.
"""

import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from configs import convergence as study_config
from configs import gpt as gpt_config
from configs import mlm as mlm_config
from moejax import cli, workdir_guard
from moejax.data.tokenizer import TokenizerError
from moejax.runtime import compile_cache
from moejax.runtime import mesh as mesh_lib
from moejax.study.convergence import format_table, plot, table_rows
from moejax.study.progress import Progress
from moejax.validation import ConfigError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "convergence.py")
MODELS = ("gpt", "bert")
MESH = (2, 4)


def split_corpus(workdir: str, heldout_fraction: float, cache_dir: str) -> tuple[str, str]:
  """(train, held-out) JSON-lines files: the embedded corpus' last `heldout_fraction` of documents held out."""
  from moejax.data import corpus as data_lib

  data_dir = os.path.join(workdir, "data")
  train, heldout = os.path.join(data_dir, "train.jsonl"), os.path.join(data_dir, "heldout.jsonl")
  if not (os.path.exists(train) and os.path.exists(heldout)):
    os.makedirs(data_dir, exist_ok=True)
    with open(data_lib.embedded_corpus(cache_dir)) as f:
      lines = f.readlines()
    cut = len(lines) - max(1, int(len(lines) * heldout_fraction))
    for path, part in ((train, lines[:cut]), (heldout, lines[cut:])):
      with open(path + ".tmp", "w") as f:
        f.writelines(part)
      os.replace(path + ".tmp", path)
  return train, heldout


def train_config(
  study: ml_collections.ConfigDict, model: str, router: str, seed: int, train_file: str, cache_dir: str
) -> ml_collections.ConfigDict:
  """The trainer's config of one run: configs/gpt.py or configs/mlm.py (tiny) with the study's sizes and
  the router's overrides."""
  config = (gpt_config if model == "gpt" else mlm_config).get_config("tiny")
  config.seed = seed
  config.steps = study.steps
  config.batch_size = study.batch_size
  config.micro_batches = 1
  config.seq_len = study.seq_len
  config.mesh.update(nodes=MESH[0], gpus_per_node=MESH[1])
  config.model.update(
    num_layers=study.num_layers, d_model=study.d_model, num_heads=study.num_heads, max_len=study.seq_len, moe_every=1
  )
  config.optim.update(learning_rate=study.learning_rate, warmup_steps=study.warmup_steps)
  config.data.update(train_files=train_file, cache_dir=cache_dir, tokenizer_train_chars=study.tokenizer_train_chars)
  config.checkpoint.update(every_steps=study.steps, keep=1, use_async=False)
  config.log.update(every_steps=max(1, study.steps // 4), tensorboard=False)
  config.moe.capacity_factor = None  # dropless: the drop share at study.capacity is measured from the loads
  overrides = study_config.routers(study.d_ff, study.num_experts, MESH[0])[router]
  config.model.update(overrides["model"])
  for name, value in overrides["moe"].items():
    config.moe[name] = value
  return config


def heldout_loss(config: ml_collections.ConfigDict, run_dir: str, heldout_file: str, batches: int) -> float:
  """Mean per-prediction cross-entropy of the run's final checkpoint on `batches` batches of the held-out
  documents (BERT: a fixed masking draw)."""
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moejax.data import pipeline as pipeline_lib
  from moejax.infer.load import load_trained
  from moejax.runtime.mesh import AXES
  from moejax.train import config as config_lib
  from moejax.train import objective
  from moejax.train import trainer as trainer_lib

  model, tok, _ = load_trained(config, run_dir)
  model_cfg, moe_cfg = config_lib.validate(config)
  mesh = model.mesh
  helper = trainer_lib.Trainer.__new__(trainer_lib.Trainer)  # only its targets(): the training objective
  helper.config, helper.model_cfg, helper.tok = config, model_cfg, tok
  graphdef, state = nnx.split(model)

  @jax.jit
  def sums(state, key, tokens_BxS):
    inputs_BxS, positions_BxP, targets_BxP, weights_BxP = helper.targets(key, tokens_BxS)
    logits_BxPxV, _ = nnx.merge(graphdef, state)(inputs_BxS, positions_BxP=positions_BxP, train=False)
    loss_sum, _ = objective.cross_entropy_sums(logits_BxPxV, targets_BxP, weights_BxP)
    return loss_sum, jnp.sum(weights_BxP)

  rows = iter(pipeline_lib.packed_shard([heldout_file], tok.encode, tok.eos_id, config.seq_len, 0, 1))
  sharding = NamedSharding(mesh, P(AXES))
  key = jax.random.key(1234)
  total, count = 0.0, 0.0
  for i in range(batches):
    tokens = np.stack([next(rows) for _ in range(config.batch_size)])
    loss_sum, weight = sums(state, jax.random.fold_in(key, i), jax.device_put(tokens, sharding))
    total, count = total + float(loss_sum), count + float(weight)
  return total / max(count, 1.0)


def load_curves(records: list[dict], capacity: float) -> dict:
  """Per step: busiest expert's load over the mean, and the share of token-choices above `capacity` x the
  mean load, both averaged over the MoE layers."""
  busiest, dropped = [], []
  for r in records:
    load_MxE = np.asarray(r["expert_load"], np.float64)
    share_MxE = load_MxE / np.maximum(load_MxE.sum(axis=1, keepdims=True), 1e-12)
    num_experts = share_MxE.shape[1]
    busiest.append(float(np.mean(share_MxE.max(axis=1) * num_experts)))
    dropped.append(float(np.mean(np.maximum(share_MxE - capacity / num_experts, 0.0).sum(axis=1))))
  return {"busiest_load": busiest, "drop_share": dropped}


def run_dir_of(workdir: str, model: str, router: str, seed: int) -> str:
  return os.path.join(workdir, "runs", model, router, f"seed{seed}")


def run_one(study, model: str, router: str, seed: int, files: tuple[str, str], workdir: str, cache_dir: str) -> dict:
  """Trains (unless finished before) and measures one run; its result is kept in the run's result.json."""
  from moejax.train import metrics as metrics_lib
  from moejax.train import trainer as trainer_lib

  run_dir = run_dir_of(workdir, model, router, seed)
  result_path = os.path.join(run_dir, "result.json")
  if os.path.exists(result_path):
    with open(result_path) as f:
      return {**json.load(f), "reused": True}
  config = train_config(study, model, router, seed, files[0], cache_dir)
  start = time.perf_counter()
  if not os.path.exists(os.path.join(run_dir, "summary.json")):
    trainer_lib.train(config, run_dir)
  records = metrics_lib.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  result = {
    "model": model,
    "router": router,
    "seed": seed,
    "steps": [r["step"] for r in records],
    "train_loss": [r["task_loss"] for r in records],
    "aux_loss": [r["aux_loss"] for r in records],
    **load_curves(records, study.capacity),
    "heldout_loss": heldout_loss(config, run_dir, files[1], study.heldout_batches),
    "seconds": time.perf_counter() - start,
  }
  with open(result_path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(result_path + ".tmp", result_path)
  return result


def run_study(config: ml_collections.ConfigDict, workdir: str, models, cache_dir: str | None = None) -> list[dict]:
  """Trains (or re-uses) every run of `models` x config.routers x config.seeds in `workdir`, writes the
  results, table and plots there, prints the table; returns the table's rows. cache_dir: where the corpus
  and tokenizers are cached (default <workdir>/cache). Expects the 2 x 4 mesh's devices
  (`mesh_lib.simulate_cpu_devices` on CPU)."""
  os.makedirs(workdir, exist_ok=True)
  cache_dir = cache_dir or os.path.join(workdir, "cache")
  files = split_corpus(workdir, config.heldout_fraction, cache_dir)
  runs = [(m, r, s) for m in models for r in config.routers for s in config.seeds]
  # The ETA counts the runs trained here, not those whose result an earlier study left.
  progress = Progress(sum(not os.path.exists(os.path.join(run_dir_of(workdir, *run), "result.json")) for run in runs))
  results = []
  for model, router, seed in runs:
    result = run_one(config, model, router, seed, files, workdir, cache_dir)
    results.append(result)
    line = (
      f"{model} {router} seed {seed}: held-out loss {result['heldout_loss']:.4f}, final train loss "
      f"{result['train_loss'][-1]:.4f}, busiest load {np.mean(result['busiest_load']):.3f}"
    )
    print(
      f"{line} (re-used)" if result.get("reused") else progress.step(f"{line}, {result['seconds']:.0f} s"), flush=True
    )
  rows = table_rows(results, tail=max(1, config.steps // 10))
  table = format_table(rows, config.capacity)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(
      {
        "config": config.to_dict(),
        "mesh": MESH,
        "table": rows,
        "runs": [{k: v for k, v in r.items() if k != "reused"} for r in results],
      },
      f,
      indent=1,
    )
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(table + "\n")
  paths = plot(results, workdir)
  print(table)
  print("wrote", ", ".join([os.path.join(workdir, "results.json"), os.path.join(workdir, "table.md"), *paths]))
  return rows


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  for name, known in (("models", MODELS), ("routers", study_config.ROUTERS)):
    unknown = sorted(set(config[name]) - set(known))
    if unknown or not config[name]:
      sys.exit(f"error: {name} {unknown or list(config[name])}: choose among {list(known)}")
  workdir_guard.claim(workdir, "experiments.convergence")  # its runs and results, never in another's workdir
  mesh_lib.simulate_cpu_devices(MESH[0] * MESH[1])  # Before JAX starts its backends.
  # A router's seeds (and a resumed study) compile the same programs: JAX's persistent cache loads them
  # (a GPT run 31 -> 18 s on 2 CPU cores), where this jaxlib runs what it loads (compile_cache).
  compile_cache.use(os.path.join(workdir, "cache", "xla"))
  try:
    run_study(config, workdir, config.models)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/convergence.py).")
  _WORKDIR = cli.define_workdir("Directory for the runs and the results.")
  cli.run(main)
