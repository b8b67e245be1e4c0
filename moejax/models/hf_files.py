"""The safetensors files of a Hugging Face checkpoint directory, read lazily (`moejax.models.hf_checkpoint`)."""

import json
import os

from safetensors import SafetensorError, safe_open

from moejax.validation import ConfigError


class Shards:
  """The safetensors files of a checkpoint directory: name -> lazily sliced tensor. Headers are read once; one file
  is mapped at a time (switching files closes the last), so a load maps about one shard, not the checkpoint."""

  def __init__(self, directory: str):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
      files = ["model.safetensors"]
    else:
      raise ConfigError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    self.directory, self.where, self.open_file, self.handle = directory, {}, None, None
    for file in files:
      with self._open(file) as handle:
        self.where.update({name: file for name in handle.keys()})

  def _open(self, file: str):
    path = os.path.join(self.directory, file)
    try:
      return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
      raise ConfigError(f"checkpoint file {path} cannot be read (truncated or not safetensors): {e}") from e

  def tensor(self, name: str):
    file = self.where[name]
    if file != self.open_file:
      self.close()
      self.handle = self._open(file)
      self.handle.__enter__()
      self.open_file = file
    return self.handle.get_slice(name)

  def close(self) -> None:
    if self.handle is not None:
      self.handle.__exit__(None, None, None)
      self.handle, self.open_file = None, None
