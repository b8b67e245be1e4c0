"""A training config named as a program's config argument names it: a config file of configs/ and, after a colon,
its own argument ('mlm', 'gpt:13b', 'decoder:qwen3_moe,published'); for the programs whose config is a model's
training config plus their own fields (configs/record_traces.py, configs/memory.py)."""

import importlib

import ml_collections

TRAINING_CONFIGS = ("mlm", "gpt", "decoder")


def load(spec: str) -> ml_collections.ConfigDict:
  """The config `spec` names; ValueError naming the choices for another file."""
  name, _, arg = spec.partition(":")
  if name not in TRAINING_CONFIGS:
    raise ValueError(f"unknown training config {name!r}; choose one of {TRAINING_CONFIGS} (configs/<name>.py)")
  return importlib.import_module(f"configs.{name}").get_config(*([arg] if arg else []))
