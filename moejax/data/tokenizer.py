"""SentencePiece tokenizers: the model file a config names, or one trained on the corpus and cached.

A trained tokenizer reserves pad=0, eos=1, unk=2 (T5's layout) and a `[MASK]` piece at 3. A named
model without a `[MASK]` piece (T5's, for example) gets the mask id right after its last piece.
"""

import contextlib
import fcntl
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterable

import sentencepiece as spm
from absl import logging

from moejax.data import TokenizerError
from moejax.data.hf_tokenizer import HFTokenizer
from moejax.validation import require

MASK_PIECE = "[MASK]"


class Tokenizer:
  """A SentencePiece model with the ids the objectives need.

  Ordinary ids (the ones masking may select or draw) form the range [first_ordinary,
  first_ordinary + num_ordinary); every id used is below `num_ids`.
  """

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
    size = self.sp.get_piece_size()
    self.pad_id, self.eos_id = self.sp.pad_id(), self.sp.eos_id()
    if self.pad_id < 0 or self.eos_id < 0:
      raise TokenizerError(
        f"the SentencePiece model needs pad and eos pieces (pad_id={self.pad_id}, eos_id={self.eos_id})"
      )
    mask = self.sp.piece_to_id(MASK_PIECE)
    self.mask_id = mask if self.sp.id_to_piece(mask) == MASK_PIECE else size
    ordinary = [
      i
      for i in range(size)
      if i != self.mask_id and not (self.sp.is_control(i) or self.sp.is_unknown(i) or self.sp.is_unused(i))
    ]
    if not ordinary or ordinary != list(range(ordinary[0], ordinary[0] + len(ordinary))):
      raise TokenizerError("the SentencePiece model's special pieces must all come before its ordinary pieces")
    self.first_ordinary, self.num_ordinary = ordinary[0], len(ordinary)
    self.num_ids = max(size, self.mask_id + 1)

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self.sp.decode([int(i) for i in ids if i < self.sp.get_piece_size()])


def require_fits(tok, vocab_size: int) -> None:
  """ConfigError naming model.vocab_size unless the model has an embedding row for each of `tok`'s ids (a
  `Tokenizer` or `objective.TokenIds`; None: none to check): an id past the table would read no row, and the loss
  would be NaN."""
  if tok is not None:
    require(tok.num_ids <= vocab_size, "model.vocab_size", vocab_size, f"at least the tokenizer's {tok.num_ids} ids")


@contextlib.contextmanager
def cache_lock(directory: str):
  """Holds an exclusive lock on `directory`, so that processes sharing it build a file once."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def train(texts: Iterable[str], vocab_size: int) -> bytes:
  """Trains a unigram SentencePiece model with pad=0, eos=1, unk=2, [MASK]=3; returns its bytes.
  A corpus too small for `vocab_size` pieces gets fewer."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=model,
    vocab_size=vocab_size,
    model_type="unigram",
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    user_defined_symbols=[MASK_PIECE],
    character_coverage=0.9995,
    hard_vocab_limit=False,
    num_threads=min(16, os.cpu_count() or 1),
    minloglevel=2,
  )
  return model.getvalue()


def load_or_train(
  model_file: str, cache_dir: str, vocab_size: int, corpus_key: str, texts: Callable[[], Iterable[str]]
) -> Tokenizer:
  """The tokenizer in `model_file` if given (a SentencePiece model, or a checkpoint's tokenizer.json), else one trained on `texts()` and cached in `cache_dir`
  under a name derived from `corpus_key` and `vocab_size` (built once by whichever process gets there
  first; the others wait and load it)."""
  if model_file.endswith(".json"):  # a Hugging Face checkpoint's tokenizer.json
    return HFTokenizer(model_file)
  if model_file:
    with open(model_file, "rb") as f:
      return Tokenizer(f.read())
  digest = hashlib.sha1(json.dumps([corpus_key, vocab_size]).encode()).hexdigest()[:12]
  path = os.path.join(cache_dir, f"spm-{vocab_size}-{digest}.model")
  with cache_lock(cache_dir):
    if not os.path.exists(path):
      logging.info("training a %d-piece SentencePiece tokenizer; it will be cached at %s", vocab_size, path)
      proto = train(texts(), vocab_size)
      with open(path + ".tmp", "wb") as f:
        f.write(proto)
      os.replace(path + ".tmp", path)
  with open(path, "rb") as f:
    return Tokenizer(f.read())
