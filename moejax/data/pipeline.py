"""Training batches through grain: each data shard's documents (`moejax.data.sources`) tokenized and packed into
rows of seq_len tokens, the shards of this process zipped into its rows of every micro-batch, prefetched.

Packing: the documents' tokens, each document followed by eos, are concatenated and cut into rows of seq_len; a
document that does not fit continues at the start of the shard's next row. Nothing marks the boundaries but eos:
attention crosses them, as it always has here.

Sharding: the corpus is split into S = data.shards shards; each owns a fixed block of B / S rows of every
micro-batch, and process p of P (grain's ShardOptions, `ShardByJaxProcess` in training) reads shards
[p S / P, (p + 1) S / P), exactly the rows its devices hold. So the global batch depends on the data and S, never on
the number of processes, and nothing in it is random: the same config gives the same batches.

State: one dict per shard (STATE_FIELDS: the next record's epoch, file and index, the tokens of the current
document already packed, the documents started, the malformed records skipped), JSON-serialisable; restoring it
continues with exactly the rows that would have come next. It is the state after the last batch returned, however
far the prefetch thread has read.
"""

from collections.abc import Callable

import grain
import numpy as np

from moejax.data.sources import SOURCE_FIELDS, Documents

STATE_FIELDS = (*SOURCE_FIELDS, "offset", "documents")


class Packed(grain.IterDataset):
  """Rows [seq_len] int32 of `parent`'s token lists packed back to back; state: STATE_FIELDS."""

  def __init__(self, parent: grain.IterDataset, seq_len: int):
    super().__init__(parent)
    self.seq_len = seq_len

  def __iter__(self):
    return _PackedIterator(self._parent.__iter__(), self.seq_len)


class _PackedIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator, seq_len: int):
    super().__init__(parent)
    self.seq_len = seq_len
    self._start, self._tokens, self._offset, self._documents = parent.get_state(), None, 0, 0

  def get_state(self) -> dict:
    """The parent's state before the current document, the tokens of it packed, the documents started."""
    return {**self._start, "offset": self._offset, "documents": self._documents}

  def set_state(self, state: dict) -> None:
    self._start = {k: state[k] for k in SOURCE_FIELDS}
    self._parent.set_state(self._start)
    self._tokens, self._offset, self._documents = None, int(state["offset"]), int(state["documents"])
    if self._offset:  # inside a document: it was started (and counted) before the state was taken
      self._tokens = self._parent.__next__()

  def __next__(self) -> np.ndarray:
    row = []
    while len(row) < self.seq_len:
      if self._tokens is None or self._offset == len(self._tokens):
        self._start = self._parent.get_state()
        self._tokens, self._offset = self._parent.__next__(), 0
        self._documents += 1
      take = self._tokens[self._offset : self._offset + self.seq_len - len(row)]
      row.extend(take)
      self._offset += len(take)
    return np.asarray(row, np.int32)


def packed_shard(
  files: list[str],
  encode: Callable[[str], list[int]],
  eos_id: int,
  seq_len: int,
  shard: int,
  num_shards: int,
  *,
  heldout_every: int = 0,
  heldout: bool = False,
) -> Packed:
  """Shard `shard` of `num_shards`' rows [seq_len] (the held-out split's, once, with `heldout`)."""
  documents = Documents(files, shard, num_shards, heldout_every=heldout_every, heldout=heldout, repeat=not heldout)
  return Packed(documents.map(lambda text: encode(text) + [eos_id]), seq_len)


class Batches:
  """This process's rows of every step's batch: tokens [micro_batches, rows / P, seq_len] int32.

  rows: B, the global rows of one micro-batch. shard_options: this process' index and the process count P
  (grain.sharding.ShardByJaxProcess() in training). states: one state per shard of this process (from `state()`),
  or None to start at the beginning. heldout_every: every k-th record of each file left out (k > 0). prefetch:
  batches a background thread prepares ahead (0: none).
  """

  def __init__(
    self,
    files: list[str],
    tok,
    *,
    seq_len: int,
    rows: int,
    micro_batches: int,
    num_shards: int,
    shard_options: grain.sharding.ShardOptions = grain.sharding.NoSharding(),
    states: list | None = None,
    prefetch: int = 2,
    heldout_every: int = 0,
  ):
    index, count = shard_options.shard_index, shard_options.shard_count
    if num_shards % count or rows % num_shards:
      raise ValueError(
        f"data.shards={num_shards} must be a multiple of the {count} processes "
        f"and divide the {rows} rows of a micro-batch"
      )
    per_process = num_shards // count
    shards = [
      packed_shard(files, tok.encode, tok.eos_id, seq_len, s, num_shards, heldout_every=heldout_every).batch(
        rows // num_shards, drop_remainder=True
      )
      for s in range(index * per_process, (index + 1) * per_process)
    ]
    ds = grain.experimental.ZipIterDataset(shards).map(np.concatenate).batch(micro_batches, drop_remainder=True)
    self._iter = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch).__iter__()
    if states is not None:
      self._iter.set_state({"parents": states})

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    return self._iter.__next__()

  def state(self) -> list[dict]:
    return [dict(s) for s in self._iter.get_state()["parents"]]

  def close(self) -> None:
    self._iter.close()


def heldout_tokens(files: list[str], tok, heldout_every: int, batches: int, rows: int, seq_len: int) -> np.ndarray:
  """The held-out batches [batches, rows, seq_len] int32: the held-out records of `files` (every heldout_every-th)
  packed in order as one shard packs its documents; ValueError when they hold fewer tokens than that."""
  rows_needed = batches * rows
  got = []
  try:
    for row in packed_shard(files, tok.encode, tok.eos_id, seq_len, 0, 1, heldout_every=heldout_every, heldout=True):
      got.append(row)
      if len(got) == rows_needed:
        return np.stack(got).reshape(batches, rows, seq_len)
  except ValueError:  # no held-out document at all
    pass
  raise ValueError(
    f"the held-out split (every {heldout_every}th document) holds fewer than the {batches} x {rows} "
    f"x {seq_len} tokens asked for"
  )
