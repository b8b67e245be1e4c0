"""The data sources (JSON lines, gzipped, Parquet, ArrayRecord), packing against a plain loop, process sharding,
resumable state, bad files refused, tokenizers and BERT masking."""

import gzip
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.data import corpus, pipeline, sources, tokenizer
from moejax.train import objective
from moejax.validation import ConfigError

WORDS = (
  "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras "
  "and every morning the baker sells fresh bread to curious neighbours"
).split()


def _documents(count, seed=0):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(5, 60))).capitalize() + "." for _ in range(count)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  cache = tmp_path_factory.mktemp("tok")
  return tokenizer.load_or_train("", str(cache), 96, "words", lambda: _documents(2000))


def _write_jsonl(path, texts, gz=False):
  lines = b"".join(json.dumps({"text": t, "url": f"u{i}"}).encode() + b"\n" for i, t in enumerate(texts))
  with gzip.open(path, "wb") if gz else open(path, "wb") as f:
    f.write(lines)


def _packed(tok, texts, seq_len):
  """The rows [n, seq_len] a plain loop packs `texts` into: each text's tokens and eos, back to back (the reference)."""
  flat = [t for text in texts for t in tok.encode(text) + [tok.eos_id]]
  n = len(flat) // seq_len
  return np.asarray(flat[: n * seq_len], np.int32).reshape(n, seq_len)


def _write(path, texts):
  """`texts` as a data file of `path`'s format (JSON lines, gzipped, Parquet or ArrayRecord)."""
  path = str(path)
  if path.endswith(".parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, "url": [f"u{i}" for i in range(len(texts))]}), path, row_group_size=7)
  elif path.endswith(".array_record"):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:4")
    for t in texts:
      writer.write(json.dumps({"text": t}).encode())
    writer.close()
  else:
    _write_jsonl(path, texts, gz=path.endswith(".gz"))


def _rows(ds, count):
  it = iter(ds)
  return np.stack([next(it) for _ in range(count)])


def test_malformed_lines_are_skipped_and_counted(tmp_path, tok):
  good = _documents(6, seed=1)
  bad = [
    b"{not json\n",
    b"[1, 2, 3]\n",
    b'{"url": "no text"}\n',
    b'{"text": 42}\n',
    b'{"text": "\xff\xfe bad utf-8"}\n',
    b"\n",
    b'"just a string"\n',
  ]
  lines = [json.dumps({"text": t}).encode() + b"\n" for t in good]
  mixed = [
    lines[0],
    bad[0],
    lines[1],
    bad[1],
    bad[2],
    lines[2],
    bad[3],
    bad[4],
    lines[3],
    bad[5],
    bad[6],
    lines[4],
    lines[5].rstrip(b"\n"),
  ]  # last line without newline
  path = tmp_path / "mixed.json"
  path.write_bytes(b"".join(mixed))
  truncated = tmp_path / "truncated.json.gz"
  _write_jsonl(truncated, _documents(50, seed=2), gz=True)
  truncated.write_bytes(truncated.read_bytes()[:300])  # a partial download
  files = [str(path), str(truncated)]

  assert list(sources.texts([str(path)])) == good
  want = _packed(tok, good, 16)
  it = iter(pipeline.packed_shard(files, tok.encode, tok.eos_id, 16, 0, 1))
  np.testing.assert_array_equal(np.stack([next(it) for _ in range(len(want))]), want)
  while it.get_state()["epoch"] == 0:  # through the truncated file and around again, without raising
    next(it)
  # 7 bad lines in mixed.json (the empty line among them); the broken gzip stream, and perhaps
  # the torn line before the break.
  assert it.get_state()["malformed"] in (8, 9)


def test_parse_record():
  assert sources.parse_record(b'{"text": "hi", "timestamp": "2019"}') == "hi"
  assert sources.parse_record(b'{"text": null}') is None
  assert sources.parse_record(b"\xc3\x28") is None


@pytest.mark.parametrize("ext", [".jsonl", ".json.gz", ".parquet", ".array_record"])
def test_every_format_packs_its_documents_as_a_plain_loop_does(tmp_path, tok, ext):
  """Two files of a format, 4 shards (by record), every 5th record held out: shard s's rows are the plain-loop
  packing of the kept records s, s + 4, ... of each file in turn; the held-out rows those of the held-out records."""
  texts = [_documents(30, seed=3), _documents(25, seed=4)]
  files = [str(tmp_path / f"part-{i}{ext}") for i in range(2)]
  for path, part in zip(files, texts):
    _write(path, part)
  sources.check_files(files)
  k = 5
  kept = [[t for i, t in enumerate(part) if i % k != k - 1] for part in texts]
  for shard in range(4):
    want = _packed(tok, kept[0][shard::4] + kept[1][shard::4], 8)
    got = _rows(pipeline.packed_shard(files, tok.encode, tok.eos_id, 8, shard, 4, heldout_every=k), len(want))
    np.testing.assert_array_equal(got, want)
  held = [t for part in texts for t in part[k - 1 :: k]]
  want = _packed(tok, held, 8)[:6]
  np.testing.assert_array_equal(
    pipeline.heldout_tokens(files, tok, k, batches=2, rows=3, seq_len=8), want.reshape(2, 3, 8)
  )


def test_resuming_from_a_state_continues_with_the_same_batches(tmp_path, tok):
  files = []
  for i in range(3):
    files.append(str(tmp_path / f"c4-{i}.json.gz"))
    _write_jsonl(files[-1], _documents(40, seed=10 + i), gz=True)
  for shards in (2, 4):  # 3 files: by file for 2 shards, by record for 4
    kwargs = dict(seq_len=32, rows=shards * 2, micro_batches=2, num_shards=shards)
    for cut in (1, 7, 23):
      batches = pipeline.Batches(files, tok, prefetch=3, **kwargs)  # the prefetch thread reads ahead
      for _ in range(cut):
        next(batches)
      state = json.loads(json.dumps(batches.state()))  # survives a JSON round trip
      tail = [next(batches) for _ in range(30)]
      assert max(s["epoch"] for s in batches.state()) > max(s["epoch"] for s in state)  # across an epoch's end
      batches.close()
      resumed = pipeline.Batches(files, tok, states=state, prefetch=0, **kwargs)
      for want in tail:
        np.testing.assert_array_equal(next(resumed), want)
      resumed.close()


def test_global_batch_does_not_depend_on_the_process_count(tmp_path, tok):
  files = []
  for i in range(2):
    files.append(str(tmp_path / f"c4-{i}.json"))
    _write_jsonl(files[-1], _documents(30, seed=20 + i))
  kwargs = dict(seq_len=24, rows=8, micro_batches=2, num_shards=4)
  single = pipeline.Batches(files, tok, prefetch=0, **kwargs)
  pair = [pipeline.Batches(files, tok, shard_options=grain.sharding.ShardOptions(p, 2), **kwargs) for p in range(2)]
  # Shard s of 4 (by record: 2 files < 4 shards) packs records s, s + 4, ... of each file: rows 2s, 2s + 1.
  shard_rows = [_packed(tok, _documents(30, seed=20)[s::4] + _documents(30, seed=21)[s::4], 24) for s in range(4)]
  for step in range(5):
    whole = next(single)
    assert whole.shape == (2, 8, 24)
    np.testing.assert_array_equal(whole, np.concatenate([next(b) for b in pair], axis=1))
    for u in range(2):
      i = 2 * (2 * step + u)
      np.testing.assert_array_equal(whole[u], np.concatenate([rows[i : i + 2] for rows in shard_rows]))
  assert single.state()[2:] == pair[1].state()
  # Restarting both processes from their states continues the same global batches.
  resumed = [
    pipeline.Batches(files, tok, shard_options=grain.sharding.ShardOptions(p, 2), states=pair[p].state(), **kwargs)
    for p in range(2)
  ]
  for _ in range(3):
    np.testing.assert_array_equal(next(single), np.concatenate([next(b) for b in resumed], axis=1))
  for b in (single, *pair, *resumed):
    b.close()
  with pytest.raises(ValueError, match="data.shards"):
    pipeline.Batches(files, tok, shard_options=grain.sharding.ShardOptions(0, 3), **kwargs)


def test_an_empty_shard_is_an_error_not_a_hang(tmp_path, tok):
  path = tmp_path / "one.json"
  _write_jsonl(path, _documents(1))
  with pytest.raises(ValueError, match="no documents"):
    _rows(pipeline.packed_shard([str(path)], tok.encode, tok.eos_id, 8, 3, 4), 1)


def test_bad_data_files_are_refused_naming_them(tmp_path):
  _write_jsonl(tmp_path / "ok.jsonl", ["fine"])
  (tmp_path / "broken.json.gz").write_bytes(b"not gzip at all")
  (tmp_path / "broken.parquet").write_bytes(b"PAR1 not parquet")
  (tmp_path / "broken.array_record").write_bytes(b"not an array record")
  (tmp_path / "data.csv").write_text("text\nhello\n")
  for name, match in (
    ("missing.jsonl", "cannot be read"),
    ("broken.json.gz", "cannot be read"),
    ("broken.parquet", "cannot be read"),
    ("broken.array_record", "cannot be read"),
    ("data.csv", "none of the extensions"),
  ):
    path = str(tmp_path / name)
    with pytest.raises(ConfigError, match=match) as error:
      sources.check_files([str(tmp_path / "ok.jsonl"), path])
    assert path in str(error.value) and error.value.field == "data.train_files"


def test_trained_tokenizer_is_cached_and_reloads_as_a_named_model(tmp_path, tok):
  assert (tok.pad_id, tok.eos_id, tok.mask_id, tok.first_ordinary) == (0, 1, 3, 4)
  assert tok.num_ids == 96 and tok.num_ordinary == 92
  calls = []

  def texts():
    calls.append(1)
    return _documents(500)

  first = tokenizer.load_or_train("", str(tmp_path), 100, "key", texts)
  again = tokenizer.load_or_train("", str(tmp_path), 100, "key", texts)
  assert len(calls) == 1 and first.model_proto == again.model_proto
  [model_file] = [f for f in os.listdir(tmp_path) if f.endswith(".model")]
  named = tokenizer.load_or_train(str(tmp_path / model_file), "", 0, "", None)
  assert named.encode("the lazy dog") == first.encode("the lazy dog")
  assert first.decode(first.encode("the lazy dog")) == "the lazy dog"


@pytest.mark.slow
def test_embedded_corpus_is_real_text(shared):
  [path] = corpus.corpus_files("", str(shared / "cache"))
  texts = list(sources.texts([path]))
  assert len(texts) > 1000
  assert sum(map(len, texts)) > 1_000_000
  assert sum("Return" in t for t in texts[:200]) > 20
  assert corpus.corpus_files("", str(shared / "cache")) == [path]  # cached


def test_bert_masking_statistics():
  first, count, mask_id = 10, 990, 3
  rng = np.random.default_rng(0)
  tokens = rng.integers(first, first + count, (256, 128)).astype(np.int32)
  tokens[:, ::9] = 1  # separators are never selected
  tokens[:4, :] = 0  # an all-padding row has nothing to predict
  inputs, positions, targets, weights = jax.jit(
    lambda k, t: objective.bert_mask(k, t, mask_id=mask_id, first_ordinary=first, num_ordinary=count)
  )(jax.random.key(0), jnp.asarray(tokens))
  inputs, positions, targets, weights = map(np.asarray, (inputs, positions, targets, weights))
  assert positions.shape == (256, 19) and weights.shape == (256, 19)  # round(0.15 * 128)
  assert weights[:4].sum() == 0 and weights[4:].min() == 1
  rows = np.arange(256)[:, None]
  np.testing.assert_array_equal(targets, tokens[rows, positions])
  chosen = np.zeros_like(tokens, bool)
  chosen[rows[4:], positions[4:]] = True
  assert (chosen.sum(axis=1)[4:] == 19).all()  # distinct positions
  assert (tokens[chosen] >= first).all()
  np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])
  new, old = inputs[chosen], tokens[chosen]
  masked, kept = np.mean(new == mask_id), np.mean(new == old)
  replaced = np.mean((new != mask_id) & (new != old))
  n = chosen.sum()
  for share, want in ((masked, 0.8), (replaced, 0.1 * (1 - 1 / count)), (kept, 0.1 + 0.1 / count)):
    assert abs(share - want) < 4 * np.sqrt(want * (1 - want) / n), (share, want)
  assert ((new[new != mask_id] >= first) & (new[new != mask_id] < first + count)).all()
  # Over the selected positions the choice is uniform: each column of the sequence is chosen ~15%.
  per_column = chosen[4:].mean(axis=0)[np.arange(128) % 9 != 0]
  assert abs(per_column.mean() - 19 / (128 - 15)) < 0.01 and per_column.std() < 0.05
