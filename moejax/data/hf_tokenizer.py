"""A Hugging Face checkpoint's tokenizer (tokenizer.json, read by the `tokenizers` library) with the ids the
objectives need, for fine-tuning a checkpoint on text it can read."""

import json
import os
from collections.abc import Iterable

from moejax.data import TokenizerError


def _special(directory: str) -> dict:
  """The eos and pad token strings of tokenizer_config.json beside tokenizer.json (a string or {"content": ...})."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    config = json.load(f)
  content = lambda v: v.get("content") if isinstance(v, dict) else v
  return {k: content(config.get(k)) for k in ("eos_token", "pad_token") if config.get(k)}


class HFTokenizer:
  """tokenizer.json's model. eos ends each document (tokenizer_config.json's eos_token, else config.json's
  eos_token_id); pad is its pad_token, else eos. Decoders train on next tokens, so nothing is masked (mask_id is
  pad_id) and every id is ordinary."""

  def __init__(self, path: str):
    import tokenizers  # a dependency of moejax; imported here so that SentencePiece runs never load it

    try:
      self.tk = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the library's own error type varies by version
      raise TokenizerError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from e
    directory = os.path.dirname(os.path.abspath(path))
    special = _special(directory)
    eos = self.tk.token_to_id(special["eos_token"]) if "eos_token" in special else self._config_eos(directory)
    if eos is None:
      raise TokenizerError(
        f"{path}: no end-of-sequence token (tokenizer_config.json's eos_token, or config.json's eos_token_id)"
      )
    pad = self.tk.token_to_id(special["pad_token"]) if "pad_token" in special else eos
    self.eos_id, self.pad_id = eos, eos if pad is None else pad
    self.mask_id = self.pad_id
    self.num_ids = self.tk.get_vocab_size(with_added_tokens=True)
    self.first_ordinary, self.num_ordinary = 0, self.num_ids

  @staticmethod
  def _config_eos(directory: str) -> int | None:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      eos = json.load(f).get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos

  def encode(self, text: str) -> list[int]:
    return self.tk.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self.tk.decode([int(i) for i in ids if int(i) < self.num_ids])
