"""A training run's inputs, set up before anything is compiled: its data files (the cheap checks first), the
tokenizer, the held-out batches and the training batches' grain pipeline (`moejax.data`)."""

import os

import grain
import jax
import ml_collections

from moejax.data import corpus as corpus_lib
from moejax.data import pipeline as pipeline_lib
from moejax.data import sources as sources_lib
from moejax.models import hf_files
from moejax.train import heldout as heldout_lib
from moejax.validation import require


def check(config: ml_collections.ConfigDict) -> None:
  """The data section's checks that need the job: held-out evaluation's fields, data.shards over the processes."""
  heldout_lib.check(config)
  require(
    config.data.shards % jax.process_count() == 0,
    "data.shards",
    config.data.shards,
    f"a multiple of the job's {jax.process_count()} processes",
  )


def files_and_tokenizer(config: ml_collections.ConfigDict, workdir: str):
  """(the data files, the tokenizer): the files' cheap checks (and with config.init_from, every safetensors file's
  header read) before a tokenizer is trained or loaded (cached in data.cache_dir, else <workdir>/cache)."""
  cache_dir = config.data.cache_dir or os.path.join(workdir, "cache")
  files = corpus_lib.corpus_files(config.data.train_files, cache_dir)
  sources_lib.check_files(files)  # the inputs' cheap checks, before a tokenizer is trained or anything compiled
  if config.get("init_from"):
    hf_files.Shards(config.init_from).close()  # every safetensors file's header read
  return files, corpus_lib.load_tokenizer(config, files, cache_dir)


def heldout(config: ml_collections.ConfigDict, files, tok, say):
  """(held-out tokens [K, B, S] or None, their unigram entropy or None): with log.eval_every, said."""
  if not config.log.eval_every:
    return None, None
  tokens, baseline = heldout_lib.batches(config, files, tok)
  if tokens is not None:
    say(
      f"held-out: {tokens.shape[0]} batch(es) of {tokens.shape[1]} x {tokens.shape[2]} tokens of every "
      f"{config.data.heldout_every}th document, evaluated every {config.log.eval_every} steps and the last; their "
      f"unigram entropy {baseline:.4f} nats is the baseline a model must beat"
    )
  return tokens, baseline


def batches(config: ml_collections.ConfigDict, files, tok, data_states) -> pipeline_lib.Batches:
  """The training batches, [micro_batches, batch_size / micro_batches, seq_len] a step, this process's shards of
  data.shards (resumed from `data_states`, or None)."""
  return pipeline_lib.Batches(
    files,
    tok,
    seq_len=config.seq_len,
    rows=config.batch_size // config.micro_batches,
    micro_batches=config.micro_batches,
    num_shards=config.data.shards,
    shard_options=grain.sharding.ShardByJaxProcess(),
    states=data_states,
    prefetch=config.data.prefetch,
    heldout_every=config.data.heldout_every,
  )
