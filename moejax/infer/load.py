"""A trained language model for inference: restored from a training workdir's checkpoints (or trained
there first), with its tokenizer, and prompts cut from corpus documents."""

import os
from collections.abc import Iterable

import ml_collections
import numpy as np
from flax import nnx

from moejax.runtime import mesh as mesh_lib
from moejax.train import checkpoint as checkpoint_lib
from moejax.train import data as data_lib
from moejax.train import model as model_lib
from moejax.train import trainer as trainer_lib
from moejax.validation import ConfigError, require


def training_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The training fields of a config that may hold other sections (e.g. 'generate')."""
  return ml_collections.ConfigDict({k: v for k, v in config.items() if k in trainer_lib.TOP_LEVEL})


def cache_dir(config: ml_collections.ConfigDict, train_workdir: str) -> str:
  """Where the training run cached its tokenizer and the embedded corpus."""
  return config.data.cache_dir or os.path.join(train_workdir, "cache")


def load_trained(config: ml_collections.ConfigDict, train_workdir: str, mesh=None, *, train_if_missing: bool = False):
  """(model, tokenizer, step) from the newest checkpoint in `train_workdir`/checkpoints, laid out on
  `mesh` (default: the config's). train_if_missing: train with `config` into `train_workdir` first
  when it holds no checkpoint; otherwise a missing checkpoint is an error naming the directory."""
  config = training_config(config)
  model_cfg, moe_cfg = trainer_lib.validate(config)
  mesh = mesh or mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  checkpoints = os.path.join(train_workdir, "checkpoints")
  if train_if_missing and not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
    trainer_lib.train(config, train_workdir)
  cache = cache_dir(config, train_workdir)
  tok = trainer_lib.load_tokenizer(config, data_lib.corpus_files(config.data.train_files, cache), cache)
  trainer = trainer_lib.Trainer(config, model_cfg, moe_cfg, mesh, tok)
  ckpt = checkpoint_lib.Checkpointer(checkpoints, keep=config.checkpoint.keep, use_async=False)
  try:
    restored = ckpt.restore_latest(trainer.abstract_state)
  finally:
    ckpt.close()
  if restored is None:
    raise ConfigError(f"no checkpoint in {checkpoints}; train one with experiments.train first", "checkpoint",
                      train_workdir, "a training workdir holding checkpoints/")
  step, state, _ = restored
  _, rest = model_lib.init_state(model_cfg, moe_cfg, mesh, config.seed)
  if "slot_tables" in state:  # the replication slot tables the run ended with
    rest = model_lib.with_slot_tables(model_cfg, rest, state["slot_tables"])
  if "expert_bias" in state:  # the balancing biases the run ended with: they choose the experts
    rest = model_lib.with_expert_biases(model_cfg, rest, state["expert_bias"])
  return nnx.merge(trainer.graphdef, state["params"], rest), tok, step


def prompts_from(texts: Iterable[str], tok, batch: int, length: int) -> np.ndarray:
  """[batch, length] int32: the first `length` tokens of the first `batch` texts that have as many."""
  rows = []
  for text in texts:
    ids = tok.encode(text)
    if len(ids) >= length:
      rows.append(ids[:length])
      if len(rows) == batch:
        return np.asarray(rows, np.int32)
  require(False, "batch", batch, f"at most the {len(rows)} texts with >= {length} tokens")
