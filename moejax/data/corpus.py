"""The corpus a run trains on: the data section's checks, its files (`data.train_files`, or the embedded default:
the docstrings of Python's standard library and its documentation topics as JSON lines, gathered once and cached)
and its tokenizer. The files are read by `moejax.data.sources` and batched by `moejax.data.pipeline`.
"""

import ast
import glob
import itertools
import json
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterator

import numpy as np

from moejax.data import tokenizer as tokenizer_lib
from moejax.data.sources import texts
from moejax.data.tokenizer import Tokenizer, cache_lock
from moejax.validation import is_int, is_number, require

CONFIG_FIELDS = (
  "train_files",
  "tokenizer_model",
  "cache_dir",
  "tokenizer_train_chars",
  "shards",
  "mask_prob",
  "prefetch",
  "heldout_every",
)


def validate_config(d, prefix: str = "", *, rows: int) -> None:
  """Checks the data section `d` (fields CONFIG_FIELDS) for micro-batches of `rows` rows; errors
  name the field with `prefix` (e.g. 'data.')."""
  require(isinstance(d.train_files, str), prefix + "train_files", d.train_files, "a comma-separated list of globs")
  if d.train_files:
    require(
      bool(corpus_files(d.train_files, "")),
      prefix + "train_files",
      d.train_files,
      "globs matching at least one data file ('' = the embedded corpus)",
    )
  require(
    isinstance(d.tokenizer_model, str) and (not d.tokenizer_model or os.path.isfile(d.tokenizer_model)),
    prefix + "tokenizer_model",
    d.tokenizer_model,
    "'' (train one), the path of a SentencePiece model or of a checkpoint's tokenizer.json",
  )
  require(isinstance(d.cache_dir, str), prefix + "cache_dir", d.cache_dir, "a directory ('' = workdir/cache)")
  require(is_int(d.tokenizer_train_chars), prefix + "tokenizer_train_chars", d.tokenizer_train_chars, "a positive int")
  require(
    is_int(d.shards) and rows % d.shards == 0,
    prefix + "shards",
    d.shards,
    f"a positive divisor of the {rows} rows of a micro-batch",
  )
  require(is_number(d.mask_prob) and 0 < d.mask_prob < 1, prefix + "mask_prob", d.mask_prob, "in (0, 1)")
  require(is_int(d.prefetch, 0), prefix + "prefetch", d.prefetch, "an int >= 0")
  require(
    is_int(d.heldout_every, 0) and d.heldout_every != 1,
    prefix + "heldout_every",
    d.heldout_every,
    "0 (nothing held out) or an int >= 2 (every k-th document of each file held out of training)",
  )


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

  def corpus():  # SentencePiece's RuntimeError on an empty corpus, as one line naming the files
    read = lines()
    first = next(read, None)
    require(first is not None, "data.train_files", ",".join(files), "files holding documents (a string text each)")
    return itertools.chain([first], read)

  key = json.dumps([[(os.path.basename(f), os.path.getsize(f)) for f in files], config.data.tokenizer_train_chars])
  tok = tokenizer_lib.load_or_train(config.data.tokenizer_model, cache_dir, config.model.vocab_size, key, corpus)
  tokenizer_lib.require_fits(tok, config.model.vocab_size)
  return tok
