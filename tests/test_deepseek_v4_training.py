"""Training DeepSeek-V4 (mHC streams around sliding, CSA and HCA attention; hash-routed then top-k MoE layers) from its
fixture's config, randomly initialised, on CPU meshes: the loss falls scanned on the 2 x 4 mesh, and a 1F1B step of
2 stages and the two-batch step equal the plain step (every metric and gradient). The pipeline needs stages alike:
the config is the fixture's with 8 layers alternating CSA + hash layer, HCA + top-k layer (two repeats a stage)."""

import json
import shutil

import jax
import numpy as np
import pytest

from configs import decoder
from moejax.pipeline import section as pipeline_section
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import trainer as train
from tests import step_checks
from tests.test_hf_models import DATA

pytestmark = pytest.mark.slow


def _checkpoint_config(directory):
  """The fixture's config.json in `directory` as a training config from random weights, 256 ids (the test tokens')."""
  config = decoder.get_config(f"hf={directory}")
  config.init_from = ""
  config.model.update(vocab_size=256)
  config.optim.warmup_steps = 1
  return config


@pytest.fixture(scope="module")
def periodic(tmp_path_factory) -> str:
  """The fixture with 8 layers: (CSA, hash MoE), (HCA, top-k MoE), four times."""
  out = tmp_path_factory.mktemp("deepseek_v4_periodic")
  shutil.copytree(DATA / "deepseek_v4", out, dirs_exist_ok=True)
  hf = json.loads((out / "config.json").read_text())
  hf.update(
    num_hidden_layers=8,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 4,
    mlp_layer_types=["hash_moe", "moe"] * 4,
  )
  (out / "config.json").write_text(json.dumps(hf))
  return str(out)


def test_the_loss_falls_scanned(devices):
  """Ten steps on one batch of random tokens on the 2 x 4 mesh, the layers scanned: the loss falls every step and
  every parameter (mHC's, the compressors' included) moves but CSA's indexer's: it only chooses entries (a top-k, no
  gradient through it; DeepSeek trains it by a loss of its own, which transformers does not have either)."""
  config = _checkpoint_config(DATA / "deepseek_v4")
  config.model.scan_layers = True
  config.optim.learning_rate = 3e-3  # the presets' (a checkpoint's config fine-tunes slower)
  config.update(batch_size=8, micro_batches=1, seq_len=16)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), step_checks.TOK, donate=False)
  state, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(2, 256, (1, 8, config.seq_len), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  first, losses = state, []
  for _ in range(10):
    state, metrics = trainer.step(state, rest, batch)
    losses.append(float(metrics["task_loss"]))
  assert losses[-1] < losses[0] - 0.2 and all(np.diff(losses) < 0), losses
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), first["params"], state["params"])
  still = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_flatten_with_path(moved)[0] if not m]
  assert still and all("['indexer']" in path for path in still), still


@pytest.mark.parametrize("schedule, stages, micro", [("1f1b", 2, 4), ("two_batch", 1, 2)])
def test_steps_pipelined_as_unpipelined(devices, periodic, schedule, stages, micro):
  def config_of(micro: int, pipeline: dict):
    config = _checkpoint_config(periodic)
    config.update(batch_size=16, micro_batches=micro, seq_len=16)
    config.mesh.update(nodes=1, gpus_per_node=4)
    config.moe.update(num_nodes=1, collective="capacity", capacity_factor=4.0)
    config.data.shards = 4
    config.pipeline = {**pipeline_section.defaults(), **pipeline}
    return config

  step_checks.check_equals_the_plain_step(config_of, schedule, stages, micro)
