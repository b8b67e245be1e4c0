"""The C4 reader, packing, process sharding, resumable state, tokenizers and BERT masking."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.data import corpus as data
from moejax.data import tokenizer
from moejax.train import objective

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras "
         "and every morning the baker sells fresh bread to curious neighbours").split()


def _documents(count, seed=0):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(5, 60))).capitalize() + "." for _ in range(count)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  cache = tmp_path_factory.mktemp("tok")
  return tokenizer.load_or_train("", str(cache), 96, "words", lambda: _documents(2000))


def _write_jsonl(path, texts, gz=False):
  lines = b"".join(json.dumps({"text": t, "url": f"u{i}"}).encode() + b"\n" for i, t in enumerate(texts))
  with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
    f.write(lines)


def _sequences(reader, count):
  return np.stack([reader.next_sequence() for _ in range(count)])


def test_malformed_lines_are_skipped_and_counted(tmp_path, tok):
  good = _documents(6, seed=1)
  bad = [b"{not json\n", b"[1, 2, 3]\n", b'{"url": "no text"}\n', b'{"text": 42}\n',
         b'{"text": "\xff\xfe bad utf-8"}\n', b"\n", b'"just a string"\n']
  lines = [json.dumps({"text": t}).encode() + b"\n" for t in good]
  mixed = [lines[0], bad[0], lines[1], bad[1], bad[2], lines[2], bad[3], bad[4], lines[3], bad[5], bad[6],
           lines[4], lines[5].rstrip(b"\n")]  # last line without newline
  path = tmp_path / "mixed.json"
  path.write_bytes(b"".join(mixed))
  truncated = tmp_path / "truncated.json.gz"
  _write_jsonl(truncated, _documents(50, seed=2), gz=True)
  truncated.write_bytes(truncated.read_bytes()[:300])  # a partial download
  files = [str(path), str(truncated)]

  assert list(data.texts([str(path)])) == good
  reader = data.ShardReader(files, 0, 1, tok, seq_len=16)
  expected = []
  for text in good:
    expected += tok.encode(text) + [tok.eos_id]
  got = np.concatenate([reader.next_sequence() for _ in range(len(expected) // 16)])
  np.testing.assert_array_equal(got, expected[:len(got)])
  while reader.state()["epoch"] == 0:  # through the truncated file and around again, without raising
    reader.next_sequence()
  # 7 bad lines in mixed.json (the empty line among them); the broken gzip stream, and perhaps
  # the torn line before the break.
  assert reader.state()["malformed"] in (8, 9)


def test_parse_line():
  assert data.parse_line(b'{"text": "hi", "timestamp": "2019"}') == "hi"
  assert data.parse_line(b'{"text": null}') is None
  assert data.parse_line(b"\xc3\x28") is None


def test_resuming_from_a_state_continues_with_the_same_tokens(tmp_path, tok):
  files = []
  for i in range(3):
    files.append(str(tmp_path / f"c4-{i}.json.gz"))
    _write_jsonl(files[-1], _documents(40, seed=10 + i), gz=True)
  for shards in (2, 4):  # 3 files: by file for 2 shards, by line for 4
    for cut in (1, 7, 23):
      head = _sequences(data.ShardReader(files, 1, shards, tok, seq_len=32), cut)
      reader = data.ShardReader(files, 1, shards, tok, seq_len=32)
      _sequences(reader, cut)
      state = json.loads(json.dumps(reader.state()))  # survives a JSON round trip
      tail = _sequences(reader, 40)
      resumed = _sequences(data.ShardReader(files, 1, shards, tok, seq_len=32, state=state), 40)
      np.testing.assert_array_equal(tail, resumed)
      assert head.shape == (cut, 32)


def test_global_batch_does_not_depend_on_the_process_count(tmp_path, tok):
  files = []
  for i in range(2):
    files.append(str(tmp_path / f"c4-{i}.json"))
    _write_jsonl(files[-1], _documents(30, seed=20 + i))
  kwargs = dict(seq_len=24, rows=8, micro_batches=2, num_shards=4, prefetch=0)
  single = data.Batches(files, tok, **kwargs)
  pair = [data.Batches(files, tok, process_index=p, process_count=2, prefetch=2,
                       **{k: v for k, v in kwargs.items() if k != "prefetch"}) for p in range(2)]
  for _ in range(5):
    whole = next(single)
    assert whole.shape == (2, 8, 24)
    np.testing.assert_array_equal(whole, np.concatenate([next(b) for b in pair], axis=1))
  assert single.state()[2:] == pair[1].state()
  # Restarting both processes from their states continues the same global batches.
  resumed = [data.Batches(files, tok, process_index=p, process_count=2, states=pair[p].state(),
                          **kwargs) for p in range(2)]
  for _ in range(3):
    np.testing.assert_array_equal(next(single), np.concatenate([next(b) for b in resumed], axis=1))
  for b in pair:
    b.close()
  with pytest.raises(ValueError, match="data.shards"):
    data.Batches(files, tok, process_count=3, **kwargs)


def test_an_empty_shard_is_an_error_not_a_hang(tmp_path, tok):
  path = tmp_path / "one.json"
  _write_jsonl(path, _documents(1))
  with pytest.raises(ValueError, match="no documents"):
    data.ShardReader([str(path)], 3, 4, tok, seq_len=8).next_sequence()


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
  [path] = data.corpus_files("", str(shared / "cache"))
  texts = list(data.texts([path]))
  assert len(texts) > 1000
  assert sum(map(len, texts)) > 1_000_000
  assert sum("Return" in t for t in texts[:200]) > 20
  assert data.corpus_files("", str(shared / "cache")) == [path]  # cached


def test_bert_masking_statistics():
  first, count, mask_id = 10, 990, 3
  rng = np.random.default_rng(0)
  tokens = rng.integers(first, first + count, (256, 128)).astype(np.int32)
  tokens[:, ::9] = 1  # separators are never selected
  tokens[:4, :] = 0  # an all-padding row has nothing to predict
  inputs, positions, targets, weights = jax.jit(
      lambda k, t: objective.bert_mask(k, t, mask_id=mask_id, first_ordinary=first, num_ordinary=count))(
          jax.random.key(0), jnp.asarray(tokens))
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
