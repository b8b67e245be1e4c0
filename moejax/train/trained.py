"""The trained model of a program that uses one (generation, ExFlow's traffic, routing traces): the training run
its config names, or one it trains first into its own workdir, restored for inference."""

import os

import ml_collections

from moejax.infer import load
from moejax.train import trainer


def run_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
  """The training workdir a program's model comes from: config.train_dir, or '' for <workdir>/train."""
  return config.train_dir or os.path.join(workdir, "train")


def trained_model(config: ml_collections.ConfigDict, workdir: str):
  """(model, tokenizer, step) of the run in `run_dir(config, workdir)`: config.train_dir is loaded as it is (an
  error names it when it holds no checkpoint); without it the config's training fields are trained into
  <workdir>/train first, unless that holds a checkpoint already."""
  train_dir = run_dir(config, workdir)
  if not config.train_dir:
    trainer.train_unless_checkpointed(config, train_dir)
  return load.load_trained(config, train_dir)
