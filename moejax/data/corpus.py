"""The corpus and training data: C4 as published (JSON lines with a `text` field, optionally gzipped), tokenized and
packed into fixed-length sequences, sharded across processes, with a resumable state.

The corpus is split into `num_shards` shards: by file (file f -> shard f % S) when there are at least
S files, else by line (line i of each file -> shard i % S). Each shard packs its documents, each
followed by eos, into sequences of `seq_len` tokens, and owns a fixed block of B / S rows of every
micro-batch; process p of P reads shards [p S / P, (p + 1) S / P), which are exactly the rows its
devices hold. So the global batch depends on the data and S, never on the number of processes.

Held out: with `heldout_every` = k > 0, line i of every file is held out when i % k == k - 1 (every k-th line,
whatever the files and shards): training never reads it, and `heldout_tokens` packs those lines alone, in order,
into the held-out batches. The kept lines are sharded by their index among the kept lines.

A malformed line (invalid JSON or UTF-8, not an object, no string `text`) or an unreadable tail of
a compressed file is skipped and counted. Without files, the corpus is the embedded default: the
docstrings of Python's standard library and its documentation topics, gathered once and cached.
"""

import ast
import glob
import gzip
import json
import os
import pathlib
import queue
import sys
import sysconfig
import threading
import zlib
from collections.abc import Iterator

import numpy as np
from absl import logging

from moejax.data import tokenizer as tokenizer_lib
from moejax.data.tokenizer import Tokenizer, cache_lock
from moejax.validation import ConfigError, is_int, is_number, require

CONFIG_FIELDS = ("train_files", "tokenizer_model", "cache_dir", "tokenizer_train_chars", "shards", "mask_prob",
                 "prefetch", "heldout_every")
STATE_FIELDS = ("epoch", "file", "line", "offset", "documents", "malformed")


def validate_config(d, prefix: str = "", *, rows: int) -> None:
  """Checks the data section `d` (fields CONFIG_FIELDS) for micro-batches of `rows` rows; errors
  name the field with `prefix` (e.g. 'data.')."""
  require(isinstance(d.train_files, str), prefix + "train_files", d.train_files, "a comma-separated list of globs")
  if d.train_files:
    require(bool(corpus_files(d.train_files, "")), prefix + "train_files", d.train_files,
            "globs matching at least one JSON-lines file ('' = the embedded corpus)")
  require(isinstance(d.tokenizer_model, str) and (not d.tokenizer_model or os.path.isfile(d.tokenizer_model)),
          prefix + "tokenizer_model", d.tokenizer_model, "'' (train one), the path of a SentencePiece model or of a checkpoint's tokenizer.json")
  require(isinstance(d.cache_dir, str), prefix + "cache_dir", d.cache_dir, "a directory ('' = workdir/cache)")
  require(is_int(d.tokenizer_train_chars), prefix + "tokenizer_train_chars", d.tokenizer_train_chars,
          "a positive int")
  require(is_int(d.shards) and rows % d.shards == 0, prefix + "shards", d.shards,
          f"a positive divisor of the {rows} rows of a micro-batch")
  require(is_number(d.mask_prob) and 0 < d.mask_prob < 1, prefix + "mask_prob", d.mask_prob, "in (0, 1)")
  require(is_int(d.prefetch, 0), prefix + "prefetch", d.prefetch, "an int >= 0")
  require(is_int(d.heldout_every, 0) and d.heldout_every != 1, prefix + "heldout_every", d.heldout_every,
          "0 (nothing held out) or an int >= 2 (every k-th document of each file held out of training)")


def embedded_corpus(cache_dir: str) -> str:
  """Path of the embedded corpus as C4-style JSON lines, written to `cache_dir` on first use."""
  version = "{}.{}.{}".format(*sys.version_info[:3])
  path = os.path.join(cache_dir, f"python-{version}-docs.jsonl")
  with cache_lock(cache_dir):
    if not os.path.exists(path):
      documents = list(_python_documents())
      order = np.random.default_rng(0).permutation(len(documents))  # mixed, like C4's files
      with open(path + ".tmp", "w") as f:
        for i in order:
          url, text = documents[i]
          f.write(json.dumps({"text": text, "url": url}) + "\n")
      os.replace(path + ".tmp", path)
  return path


def _python_documents(min_chars: int = 200) -> Iterator[tuple[str, str]]:
  """(url, text) of every module, class and function docstring of at least `min_chars` in the
  standard library (tests excluded), then the documentation topics that `help()` shows."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
  for path in sorted(root.rglob("*.py")):
    if skip & set(path.relative_to(root).parts):
      continue
    try:
      tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
      continue
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc and len(doc) >= min_chars:
          yield f"python-stdlib:{module}:{getattr(node, 'name', '')}", doc
  from pydoc_data import topics

  for name in sorted(topics.topics):
    yield f"python-docs:{name}", topics.topics[name]


def corpus_files(patterns: str, cache_dir: str) -> list[str]:
  """The sorted files matching comma-separated glob `patterns`; the embedded corpus if empty."""
  if not patterns:
    return [embedded_corpus(cache_dir)]
  return sorted({f for p in patterns.split(",") if p for f in glob.glob(os.path.expanduser(p))})


def parse_line(line: bytes) -> str | None:
  """The `text` of one JSON line, or None if the line is malformed."""
  try:
    record = json.loads(line)
  except ValueError:  # includes invalid UTF-8
    return None
  if not isinstance(record, dict) or not isinstance(record.get("text"), str):
    return None
  return record["text"]


def _open(path: str):
  return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def texts(files: list[str]) -> Iterator[str]:
  """The text of every well-formed document of `files`, in order, once."""
  for f in files:
    try:
      with _open(f) as stream:
        for raw in stream:
          text = parse_line(raw)
          if text is not None and text.strip():
            yield text
    except (EOFError, OSError, zlib.error) as e:
      logging.warning("skipping the rest of %s: %s", f, e)


class ShardReader:
  """Packs one shard's documents into sequences of `seq_len` tokens.

  state: epoch, file, line (where the current document starts), offset (its tokens already
  emitted), documents (read so far), malformed (lines skipped so far). Restoring a state continues
  with exactly the tokens that would have come next. heldout_every: k > 0 skips every k-th line of each file
  (the held-out split), or with `heldout` reads those lines alone.
  """

  def __init__(self, files: list[str], shard: int, num_shards: int, tokenizer: Tokenizer, seq_len: int,
               state: dict | None = None, heldout_every: int = 0, heldout: bool = False):
    self.files, self.shard, self.num_shards = files, shard, num_shards
    self.heldout_every, self.heldout = heldout_every, heldout
    self.by_file = len(files) >= num_shards
    self.tokenizer, self.seq_len = tokenizer, seq_len
    self._state = dict.fromkeys(STATE_FIELDS, 0) if state is None else {k: int(state[k]) for k in STATE_FIELDS}
    self._docs = self._documents(self._state["epoch"], self._state["file"], self._state["line"])
    self._tokens, self._skip = None, self._state["offset"]

  def state(self) -> dict:
    return dict(self._state)

  def _documents(self, epoch: int, file: int, line: int) -> Iterator[tuple[int, int, int, str]]:
    """(epoch, file, line, text) of this shard's documents from the given position on, forever."""
    while True:
      found = False
      for f in range(file, len(self.files)):
        if self.by_file and f % self.num_shards != self.shard:
          continue
        for i, text in self._lines(f, line if f == file else 0):
          found = True
          yield epoch, f, i, text
      if not found and file == 0 and line == 0:
        raise ValueError(f"data shard {self.shard} of {self.num_shards} has no documents in {self.files}: "
                         "lower data.shards or add data")
      epoch, file, line = epoch + 1, 0, 0

  def _lines(self, f: int, start: int) -> Iterator[tuple[int, str]]:
    """(line index, text) of this shard's well-formed lines of file f from line `start` on."""
    try:
      with _open(self.files[f]) as stream:
        for i, raw in enumerate(stream):
          if i < start or self._split(i) != self.heldout:
            continue
          if not self.by_file and self._index(i) % self.num_shards != self.shard:
            continue
          text = parse_line(raw)
          if text is None:
            self._state["malformed"] += 1
          elif text.strip():
            yield i, text
    except (EOFError, OSError, zlib.error) as e:
      if self.by_file or f % self.num_shards == self.shard:  # one count per broken file, not per shard
        self._state["malformed"] += 1
      logging.warning("skipping the rest of %s: %s", self.files[f], e)

  def _split(self, i: int) -> bool:
    """Whether line i of a file is held out."""
    return self.heldout_every > 0 and i % self.heldout_every == self.heldout_every - 1

  def _index(self, i: int) -> int:
    """Line i's index among its split's lines of the file (held-out lines before i: i // k)."""
    if not self.heldout_every:
      return i
    return i // self.heldout_every if self.heldout else i - i // self.heldout_every

  def _next_document(self):
    epoch, f, i, text = next(self._docs)
    self._state.update(epoch=epoch, file=f, line=i, offset=0)
    self._state["documents"] += 1
    self._tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_id]

  def next_sequence(self) -> np.ndarray:
    """[seq_len] int32."""
    out = []
    while len(out) < self.seq_len:
      if self._tokens is None:
        self._next_document()
        if self._skip:  # resuming inside this document: it was counted before the checkpoint
          self._state["documents"] -= 1
          self._state["offset"], self._skip = self._skip, 0
      if self._state["offset"] == len(self._tokens):
        self._tokens = None
        continue
      take = self._tokens[self._state["offset"]:self._state["offset"] + self.seq_len - len(out)]
      out.extend(take)
      self._state["offset"] += len(take)
    return np.asarray(out, np.int32)


class Batches:
  """This process's rows of every step's batch: tokens [micro_batches, rows / process_count, seq_len].

  rows: B, the global rows of one micro-batch. states: one state per shard of this process (from
  `state()`), or None to start at the beginning. heldout_every: every k-th line of each file left out (k > 0).
  With prefetch > 0 a background thread prepares that many batches ahead; `state()` is always the state after the
  last batch returned.
  """

  def __init__(self, files: list[str], tokenizer: Tokenizer, *, seq_len: int, rows: int, micro_batches: int,
               num_shards: int, process_index: int = 0, process_count: int = 1, states: list | None = None,
               prefetch: int = 2, heldout_every: int = 0):
    if num_shards % process_count or rows % num_shards:
      raise ValueError(f"data.shards={num_shards} must be a multiple of the {process_count} processes "
                       f"and divide the {rows} rows of a micro-batch")
    per_process = num_shards // process_count
    shards = range(process_index * per_process, (process_index + 1) * per_process)
    states = [None] * per_process if states is None else states
    self.readers = [ShardReader(files, s, num_shards, tokenizer, seq_len, st, heldout_every)
                    for s, st in zip(shards, states)]
    self.rows_per_shard, self.micro_batches = rows // num_shards, micro_batches
    self._state = [r.state() for r in self.readers]
    self._queue = queue.Queue(maxsize=max(prefetch, 1))
    self._stop = threading.Event()
    self._thread = None
    if prefetch > 0:
      self._thread = threading.Thread(target=self._fill, daemon=True)
      self._thread.start()

  def _make(self) -> tuple[np.ndarray, list]:
    batch = np.stack([
        np.stack([reader.next_sequence() for reader in self.readers for _ in range(self.rows_per_shard)])
        for _ in range(self.micro_batches)])
    return batch, [r.state() for r in self.readers]

  def _fill(self):
    while not self._stop.is_set():
      try:
        item = self._make()
      except Exception as e:  # handed to the consumer, which raises it
        item = e
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          pass
      if isinstance(item, Exception):
        return

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    item = self._queue.get() if self._thread else self._make()
    if isinstance(item, Exception):
      raise item
    batch, self._state = item
    return batch

  def state(self) -> list[dict]:
    return [dict(s) for s in self._state]

  def close(self):
    self._stop.set()
    if self._thread:
      self._thread.join()


def heldout_tokens(files: list[str], tokenizer: Tokenizer, heldout_every: int, batches: int, rows: int,
                   seq_len: int) -> np.ndarray:
  """The held-out batches [batches, rows, seq_len] int32: the held-out lines of `files` (every heldout_every-th)
  packed in order as one shard packs its documents; ValueError when they hold fewer tokens than that."""
  reader = ShardReader(files, 0, 1, tokenizer, seq_len, heldout_every=heldout_every, heldout=True)
  try:
    tokens = np.stack([reader.next_sequence() for _ in range(batches * rows)]).reshape(batches, rows, seq_len)
  except ValueError:  # no held-out document at all
    tokens = None
  if tokens is None or reader.state()["epoch"] > 0:
    raise ValueError(f"the held-out split (every {heldout_every}th document) holds fewer than the {batches} x {rows} "
                     f"x {seq_len} tokens asked for")
  return tokens


def check_files(files: list[str]) -> None:
  """Refuses, naming it, a data file whose first line cannot be read (missing, unreadable, a broken gzip stream): a
  cheap check before the tokenizer is trained or anything compiled (a damaged tail is found, and skipped, only when
  it is read)."""
  for path in files:
    try:
      with _open(path) as stream:
        stream.readline()
    except (EOFError, OSError, zlib.error) as e:
      raise ConfigError(f"data file {path} cannot be read: {e}", "data.train_files", path) from e


def load_tokenizer(config, files: list[str], cache_dir: str) -> Tokenizer:
  """The tokenizer of a run config (data.tokenizer_model), or one trained on the first data.tokenizer_train_chars
  of the corpus `files` and cached in `cache_dir`; it must fit in model.vocab_size."""

  def lines():
    chars = 0
    for text in texts(files):
      yield from (line for line in text.split("\n") if line.strip())
      chars += len(text)
      if chars >= config.data.tokenizer_train_chars:
        return

  key = json.dumps([[(os.path.basename(f), os.path.getsize(f)) for f in files],
                    config.data.tokenizer_train_chars])
  tok = tokenizer_lib.load_or_train(config.data.tokenizer_model, cache_dir, config.model.vocab_size, key, lines)
  require(tok.num_ids <= config.model.vocab_size, "model.vocab_size", config.model.vocab_size,
          f"at least the tokenizer's {tok.num_ids} ids")
  return tok
