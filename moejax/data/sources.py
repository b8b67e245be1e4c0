"""Documents from data files, as a grain dataset: JSON lines (C4 as published: a `text` field per line, plain or
gzipped), Parquet (a `text` column; needs pyarrow, `pip install moejax[parquet]`) and ArrayRecord (each record a
C4-style JSON object), chosen by the file's extension (FORMATS).

`Documents` is one data shard's documents, epoch after epoch: by file (file f -> shard f % S) when there are at least
S files, else by record (record i of each file -> shard i % S, i counted among its split's records). With
heldout_every = k > 0, record i of every file is held out when i % k == k - 1: the training split never reads it,
the held-out split reads those alone. A malformed record (invalid JSON or UTF-8, not an object, no string `text`)
or an unreadable tail of a file is skipped and counted in the state's `malformed`.
"""

import gzip
import json
import os
import zlib
from collections.abc import Iterator

import grain
from absl import logging

from moejax.validation import ConfigError

FORMATS = {
  ".jsonl": "jsonl",
  ".json": "jsonl",
  ".jsonl.gz": "jsonl",
  ".json.gz": "jsonl",
  ".parquet": "parquet",
  ".array_record": "arrayrecord",
  ".arrayrecord": "arrayrecord",
}
SOURCE_FIELDS = ("epoch", "file", "record", "malformed")  # a Documents iterator's state
# A file's unreadable part: a broken gzip stream, pyarrow's ArrowInvalid (a ValueError), ArrayRecord's RuntimeError.
READ_ERRORS = (EOFError, OSError, zlib.error, ValueError, RuntimeError)


def file_format(path: str) -> str:
  """'jsonl', 'parquet' or 'arrayrecord' by `path`'s extension; ConfigError naming it otherwise."""
  for ext, kind in FORMATS.items():
    if path.endswith(ext):
      return kind
  raise ConfigError(f"data file {path} has none of the extensions {', '.join(FORMATS)}", "data.train_files", path)


def parse_record(raw: bytes) -> str | None:
  """The `text` of one JSON line or record, or None if it is malformed."""
  try:
    record = json.loads(raw)
  except ValueError:  # includes invalid UTF-8
    return None
  if not isinstance(record, dict) or not isinstance(record.get("text"), str):
    return None
  return record["text"]


def _pyarrow_parquet():
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ConfigError("Parquet data files need pyarrow: pip install 'moejax[parquet]'", "data.train_files") from e
  return pq


def records(path: str, start: int = 0) -> Iterator[tuple[int, str | None]]:
  """(index, text or None when malformed) of the records of `path` from index `start` on; raises READ_ERRORS on an
  unreadable part."""
  kind = file_format(path)
  if kind == "jsonl":
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as stream:
      for i, raw in enumerate(stream):
        if i >= start:
          yield i, parse_record(raw)
  elif kind == "parquet":
    i = 0
    for batch in _pyarrow_parquet().ParquetFile(path).iter_batches(columns=["text"]):
      for text in batch.column(0).to_pylist():
        if i >= start:
          yield i, text if isinstance(text, str) else None
        i += 1
  else:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(path)
    try:
      for i in range(start, reader.num_records()):
        yield i, parse_record(reader.read([i])[0])
    finally:
      reader.close()


def _first_document(path: str) -> tuple[int, bool]:
  """(records read, whether the last of them is a document: a non-blank string `text`), reading up to the first."""
  read = 0
  for read, (_, text) in enumerate(records(path), 1):
    if text is not None and text.strip():
      return read, True
  return read, False


def check_files(files: list[str]) -> None:
  """Refuses, naming it, a data file that is missing, of an unknown extension, whose first record cannot be read
  (a broken gzip stream, a damaged Parquet footer) or that holds no document (empty, or no record with a non-blank
  string `text`: SentencePiece would fail on an empty corpus): a cheap check, reading each file up to its first
  document, before a tokenizer is trained or anything compiled (a damaged tail is found, and skipped, only when it
  is read)."""
  for path in files:
    file_format(path)
    try:
      if not os.path.isfile(path):
        raise FileNotFoundError("no such file")
      read, found = _first_document(path)
    except READ_ERRORS as e:
      raise ConfigError(f"data file {path} cannot be read: {e}", "data.train_files", path) from e
    if not found:
      what = "is empty" if not read else f"has {read} record(s), none with a non-blank string text"
      raise ConfigError(
        f'data file {path} {what}: give C4-style JSON lines, one {{"text": "..."}} object per line (Parquet: a '
        "text column), or leave it out of data.train_files",
        "data.train_files",
        path,
      )


def texts(files: list[str]) -> Iterator[str]:
  """The text of every well-formed, non-blank document of `files`, in order, once."""
  for path in files:
    try:
      yield from (text for _, text in records(path) if text is not None and text.strip())
    except READ_ERRORS as e:
      logging.warning("skipping the rest of %s: %s", path, e)


class Documents(grain.IterDataset):
  """One shard's documents (str), epoch after epoch (or one epoch with `repeat` False); state: SOURCE_FIELDS (the
  position of the next record to read and the malformed records so far). ValueError when the shard has none."""

  def __init__(
    self,
    files: list[str],
    shard: int,
    num_shards: int,
    *,
    heldout_every: int = 0,
    heldout: bool = False,
    repeat: bool = True,
  ):
    super().__init__()
    self.files, self.shard, self.num_shards = files, shard, num_shards
    self.heldout_every, self.heldout, self.repeat = heldout_every, heldout, repeat
    self.by_file = len(files) >= num_shards

  def __iter__(self):
    return _DocumentsIterator(self)

  def mine(self, f: int, i: int) -> bool:
    """Whether record i of file f is in this shard's split."""
    k = self.heldout_every
    if k and (i % k == k - 1) != self.heldout:
      return False
    if self.by_file:
      return f % self.num_shards == self.shard
    index = i if not k else (i // k if self.heldout else i - i // k)  # among the split's records of the file
    return index % self.num_shards == self.shard


class _DocumentsIterator(grain.DatasetIterator):
  def __init__(self, ds: Documents):
    super().__init__()
    self.ds = ds
    self.set_state(dict.fromkeys(SOURCE_FIELDS, 0))

  def get_state(self) -> dict:
    return dict(self._state)

  def set_state(self, state: dict) -> None:
    self._state = {k: int(state[k]) for k in SOURCE_FIELDS}
    self._walk = self._documents()

  def __next__(self) -> str:
    return next(self._walk)

  def _documents(self) -> Iterator[str]:
    ds, state = self.ds, self._state
    while True:
      found, whole = False, state["file"] == 0 and state["record"] == 0  # a whole epoch ahead
      for f in range(state["file"], len(ds.files)):
        if ds.by_file and f % ds.num_shards != ds.shard:
          continue
        try:
          for i, text in records(ds.files[f], state["record"] if f == state["file"] else 0):
            state.update(file=f, record=i + 1)
            if not ds.mine(f, i):
              continue
            if text is None:
              state["malformed"] += 1
            elif text.strip():
              found = True
              yield text
        except READ_ERRORS as e:
          if ds.by_file or f % ds.num_shards == ds.shard:  # one count per broken file, not per shard
            state["malformed"] += 1
          logging.warning("skipping the rest of %s: %s", ds.files[f], e)
        state.update(file=f + 1, record=0)
      if not found and whole:
        raise ValueError(
          f"data shard {ds.shard} of {ds.num_shards} has no documents in {ds.files}: lower data.shards or add data"
        )
      if not ds.repeat:
        return
      state.update(epoch=state["epoch"] + 1, file=0, record=0)
