"""experiments.record_traces end to end on a tiny MLM: trains two steps, records, and checks the saved
traces against the restored model's own expert counts and a separate tracing of the corpus' first batch."""

import json

import jax
import numpy as np
import pytest
from absl import flags

from configs import record_traces as traces_config
from experiments import record_traces
from moejax.cli import define_config, define_workdir
from moejax.data import corpus as data_lib
from moejax.data import pipeline as pipeline_lib
from moejax.infer import load
from moejax.placement.traces import routing_traces
from moejax.validation import ConfigError
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # trains and records traces

LAYERS, MOE_EVERY, E, K, ROWS, SEQ = 2, 1, 8, 2, 16, 16
TOKENS = 300  # more than one batch of ROWS * SEQ = 256 tokens, and not a multiple of it


def _run(monkeypatch, tmp_path, shared, *extra):
  argv = [
    "record_traces",
    f"--config={ROOT / 'configs' / 'record_traces.py'}",
    f"--workdir={tmp_path}",
    f"--config.data.cache_dir={shared / 'cache'}",
    f"--config.model.num_layers={LAYERS}",
    f"--config.model.moe_every={MOE_EVERY}",
    "--config.model.d_model=16",
    "--config.model.num_heads=2",
    "--config.model.d_ff=32",
    f"--config.model.max_len={SEQ}",
    f"--config.seq_len={SEQ}",
    f"--config.batch_size={ROWS}",
    "--config.micro_batches=1",
    f"--config.moe.num_experts={E}",
    f"--config.moe.top_k={K}",
    "--config.moe.capacity_factor=None",
    "--config.steps=2",
    "--config.checkpoint.every_steps=2",
    "--config.checkpoint.use_async=False",
    "--config.log.tensorboard=False",
    "--config.data.tokenizer_train_chars=50000",
    *extra,
  ]
  monkeypatch.setattr("sys.argv", argv)  # config_flags reads the --config.* overrides from sys.argv
  flag_values = flags.FlagValues()
  holder = define_config(str(ROOT / "configs" / "record_traces.py"), "Config.", flag_values=flag_values)
  define_workdir("Workdir.", flag_values=flag_values)
  flag_values(argv)
  record_traces.run(holder.value, flag_values.workdir)
  return holder.value


def test_traces_are_the_trained_models_choices_on_the_corpus(monkeypatch, tmp_path, shared):
  config = _run(monkeypatch, tmp_path, shared, f"--config.tokens={TOKENS}")
  traces = np.load(tmp_path / "traces.npy")
  assert traces.shape == (LAYERS // MOE_EVERY, TOKENS, K) and traces.dtype == np.int32
  assert traces.min() >= 0 and traces.max() < E
  assert np.all(traces[..., 0] != traces[..., 1])  # top-k picks distinct experts
  summary = json.loads((tmp_path / "traces.npy.json").read_text())
  assert summary["step"] == 2 and summary["shape"] == [LAYERS // MOE_EVERY, TOKENS, K]

  model, tok, _ = load.load_trained(config, str(tmp_path / "train"))
  files = data_lib.corpus_files("", str(shared / "cache"))
  first = pipeline_lib.Batches(files, tok, seq_len=SEQ, rows=ROWS, micro_batches=1, num_shards=8, prefetch=0)
  tokens_BxS = next(first)[0]
  first.close()
  # Dropless, so the layers processed every choice: per-layer counts equal the traces' bincounts.
  counts = np.asarray(jax.jit(lambda t: model(t)[1]["expert_counts"])(tokens_BxS))
  head = traces[:, : ROWS * SEQ]
  np.testing.assert_array_equal(counts, [np.bincount(layer.reshape(-1), minlength=E) for layer in head])
  np.testing.assert_array_equal(head, routing_traces(model, [tokens_BxS]))


def test_bad_token_count_is_named(tmp_path):
  config = traces_config.get_config()
  config.tokens = 0
  with pytest.raises(ConfigError, match="tokens"):
    record_traces.record(config, str(tmp_path))
