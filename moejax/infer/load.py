"""A trained language model for inference: restored from a training workdir's checkpoints (no optimizer state,
no trainer), with its tokenizer, and prompts cut from corpus documents."""

import os
from collections.abc import Iterable

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import checkpoint as checkpoint_lib
from moejax.cost import expert_backend
from moejax.data import corpus as corpus_lib
from moejax.models import presets
from moejax.models import state as state_lib
from moejax.models.config import from_sections, tokens_per_call
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError, require


def cache_dir(config: ml_collections.ConfigDict, train_workdir: str) -> str:
  """Where the training run cached its tokenizer and the embedded corpus."""
  return config.data.cache_dir or os.path.join(train_workdir, "cache")


def abstract_model_state(model_cfg, moe_cfg, mesh, seed: int = 0):
  """(graphdef, the part of a training checkpoint's state that inference restores): 'params' placed as
  `moejax.models.state.abstract_state` places them and, where the layers keep them, 'slot_tables' [M, A, Z]
  and 'expert_bias' [M, E], replicated (as `moejax.train.trainer.Trainer` saves them)."""
  graphdef, params, rest = state_lib.abstract_state(model_cfg, moe_cfg, mesh, seed)
  replicated = NamedSharding(mesh, P())
  part = {"params": params}
  for name, stacked in (
    ("slot_tables", state_lib.slot_tables(model_cfg, rest)),
    ("expert_bias", state_lib.expert_biases(model_cfg, rest)),
  ):
    if stacked is not None:
      part[name] = jax.ShapeDtypeStruct(stacked.shape, stacked.dtype, sharding=replicated)
  return graphdef, part


def load_trained(config: ml_collections.ConfigDict, train_workdir: str, mesh=None):
  """(model, tokenizer, step) from the newest checkpoint in `train_workdir`/checkpoints, laid out on
  `mesh` (default: the config's): the parameters, and the slot tables and balancing biases the run ended
  with (moe.expert_backend 'auto' resolved for a forward of the config's micro-batch). A missing checkpoint is an
  error naming the directory (`moejax.train.trainer.train_unless_checkpointed` trains one first). Of `config` it
  reads the mesh, model and moe sections (a preset applied), seed, data and checkpoint.keep."""
  config = presets.apply(config)
  model_cfg, moe_cfg = from_sections(config)
  mesh = mesh or mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  moe_cfg = expert_backend.resolve(moe_cfg, tokens_per_call(config), mesh, "fwd")  # a forward of a micro-batch
  checkpoints = os.path.join(train_workdir, "checkpoints")
  cache = cache_dir(config, train_workdir)
  tok = corpus_lib.load_tokenizer(config, corpus_lib.corpus_files(config.data.train_files, cache), cache)
  graphdef, abstract = abstract_model_state(model_cfg, moe_cfg, mesh, config.seed)
  ckpt = checkpoint_lib.Checkpointer(checkpoints, keep=config.checkpoint.keep, use_async=False)
  try:
    restored = ckpt.restore_latest(abstract, part=True)
  finally:
    ckpt.close()
  if restored is None:
    raise ConfigError(
      f"no checkpoint in {checkpoints}; train one with experiments.train first",
      "checkpoint",
      train_workdir,
      "a training workdir holding checkpoints/",
    )
  step, state, _ = restored
  _, rest = state_lib.init_state(model_cfg, moe_cfg, mesh, config.seed)
  if "slot_tables" in state:  # the replication slot tables the run ended with
    rest = state_lib.with_slot_tables(model_cfg, rest, state["slot_tables"])
  if "expert_bias" in state:  # the balancing biases the run ended with: they choose the experts
    rest = state_lib.with_expert_biases(model_cfg, rest, state["expert_bias"])
  return nnx.merge(graphdef, state["params"], rest), tok, step


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
