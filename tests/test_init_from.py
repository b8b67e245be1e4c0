"""Fine-tuning a Hugging Face checkpoint: configs/decoder.py:hf=PATH makes the run config from its config.json, the
Trainer starts from its weights and balancing biases (the first step's loss is the checkpoint's own, computed here
from its logits in float64), and the data pipeline reads its tokenizer.json."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import decoder
from moejax import models
from moejax.data import tokenizer as tokenizer_lib
from moejax.data.tokenizer import TokenizerError
from moejax.models import hf_config
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT, cpu_env

DATA = ROOT / "tests" / "data" / "hf"
pytestmark = pytest.mark.xdist_group("init_from")  # one worker builds the checkpoint copy and its tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A copy of the DeepSeek-V3 fixture (MLA, groups, sigmoid routing with its balancing bias) with a BPE
  tokenizer.json trained here on moejax's docs within the checkpoint's 96 ids, eos and pad named in
  tokenizer_config.json."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  path = tmp_path_factory.mktemp("ckpt") / "deepseek_v3"
  shutil.copytree(DATA / "deepseek_v3", path)
  lines = [line for doc in sorted((ROOT / "docs").glob("*.md")) for line in doc.read_text().splitlines()]
  tk = Tokenizer(models.BPE(unk_token="<unk>"))
  tk.pre_tokenizer = pre_tokenizers.Whitespace()
  tk.train_from_iterator(
    lines, trainers.BpeTrainer(vocab_size=90, special_tokens=["<pad>", "<eos>", "<unk>"], limit_alphabet=60)
  )
  tk.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}, "pad_token": "<pad>"}))
  return str(path)


def _config(path):
  config = decoder.get_config(f"hf={path}")
  config.update(batch_size=8, seq_len=16, micro_batches=1)
  return config


def test_config_is_the_checkpoints(checkpoint):
  config, model_cfg, moe_cfg = config_lib.checked(_config(checkpoint))
  with open(f"{checkpoint}/config.json") as f:
    want_model, want_moe = hf_config.from_hf_config(json.load(f))
  assert (model_cfg, moe_cfg) == (want_model, want_moe)
  assert config.init_from == checkpoint and config.data.tokenizer_model == f"{checkpoint}/tokenizer.json"


def test_tokenizer_json_serves_the_pipeline(checkpoint):
  tok = tokenizer_lib.load_or_train(f"{checkpoint}/tokenizer.json", "", 96, "", lambda: [])
  assert (tok.pad_id, tok.eos_id) == (0, 1) and tok.num_ids <= 96
  ids = tok.encode("the experts of a layer")
  assert ids and all(0 <= i < tok.num_ids for i in ids)
  assert "".join(tok.decode(ids).split()) == "theexpertsofalayer"  # this BPE has no word-boundary decoder


@pytest.mark.slow
def test_trainer_starts_from_the_checkpoint(checkpoint, devices):
  """Step-0 parameters and balancing biases are the checkpoint's tensors; the first step's task loss is the
  next-token cross-entropy of the loaded model's logits (float64 NumPy)."""
  config, model_cfg, moe_cfg = config_lib.checked(_config(checkpoint))
  mesh = mesh_lib.make_mesh(2, 4)
  tok = tokenizer_lib.load_or_train(config.data.tokenizer_model, "", model_cfg.vocab_size, "", lambda: [])
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh, tok, donate=False)
  state, rest = trainer.init()
  model = models.from_hf(checkpoint, mesh)
  loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state["params"])[0], jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  tensors = load_file(f"{checkpoint}/model.safetensors")
  biases = [
    tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
    for i in range(model_cfg.num_layers)
    if model_cfg.moe_layers[i]
  ]
  np.testing.assert_array_equal(np.asarray(state["expert_bias"]), np.stack(biases))
  assert np.any(np.stack(biases) != 0)

  tokens = np.random.default_rng(0).integers(2, model_cfg.vocab_size, (1, 8, 16)).astype(np.int32)
  _, metrics = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))
  logits = np.asarray(model(tokens[0])[0], np.float64)[:, :-1]  # position i predicts token i + 1
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  want = -np.take_along_axis(logp, tokens[0][:, 1:, None], -1).mean()
  np.testing.assert_allclose(float(metrics["task_loss"]), want, rtol=1e-5)


def test_bad_init_from_and_tokenizer(checkpoint, tmp_path, devices):
  config = _config(checkpoint)
  config.init_from = str(tmp_path)
  with pytest.raises(ConfigError, match="init_from"):
    config_lib.checked(config)
  config.init_from = str(DATA / "qwen3_moe")  # another model than the config's: refused naming a tensor
  config, model_cfg, moe_cfg = config_lib.checked(config)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), None, donate=False)
  with pytest.raises(ConfigError, match=r"model\.layers\.\d+\."):
    trainer.init()
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(TokenizerError, match="not a tokenizer.json"):
    tokenizer_lib.load_or_train(str(tmp_path / "tokenizer.json"), "", 96, "", lambda: [])


def test_a_checkpoint_without_a_tokenizer_needs_one_named(checkpoint, tmp_path):
  bare = tmp_path / "bare"
  shutil.copytree(checkpoint, bare)
  (bare / "tokenizer.json").unlink()
  config = _config(str(bare))
  with pytest.raises(ConfigError, match=r"data\.tokenizer_model.*has no tokenizer\.json"):
    config_lib.checked(config)
  config.data.tokenizer_model = f"{checkpoint}/tokenizer.json"
  assert config_lib.checked(config)[0].data.tokenizer_model == f"{checkpoint}/tokenizer.json"


@pytest.mark.slow
def test_fine_tuning_runs_from_the_command_line(checkpoint, tmp_path, devices):
  """experiments.train on configs/decoder.py:hf=PATH: the embedded corpus through the checkpoint's tokenizer, three
  steps from its weights; the first loss is near the checkpoint's (random weights: about log of its vocabulary); the
  run's model exported with to_hf loads back with its logits."""
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--config=configs/decoder.py:hf={checkpoint}",
      f"--workdir={tmp_path}",
      "--config.steps=3",
      "--config.batch_size=8",
      "--config.micro_batches=1",
      "--config.seq_len=16",
      "--config.log.every_steps=1",
      "--config.checkpoint.every_steps=3",
    ],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  ids = tokenizer_lib.load_or_train(f"{checkpoint}/tokenizer.json", "", 96, "", lambda: []).num_ids
  assert f"tokenizer with {ids} ids" in result.stdout  # the checkpoint's, not one trained on the corpus
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = [r["task_loss"] for r in records if "task_loss" in r]
  assert len(losses) == 3 and all(np.isfinite(losses)) and abs(losses[0] - np.log(96)) < 1.0, losses
  # The fine-tuned model back to a checkpoint: its export loads with the trained model's logits.
  from moejax.infer.load import load_trained

  config = _config(checkpoint)
  model, tok, step = load_trained(config, str(tmp_path), mesh_lib.make_mesh(2, 4))
  assert step == 3 and tok.num_ids == ids
  models.to_hf(model, str(tmp_path / "exported"))
  tokens = np.random.default_rng(3).integers(2, 96, (8, 16)).astype(np.int32)
  exported = models.from_hf(str(tmp_path / "exported"), mesh_lib.make_mesh(2, 4))
  np.testing.assert_array_equal(np.asarray(exported(tokens)[0]), np.asarray(model(tokens)[0]))
  original = models.from_hf(checkpoint, mesh_lib.make_mesh(2, 4))
  assert not np.array_equal(np.asarray(original(tokens)[0]), np.asarray(model(tokens)[0]))  # it trained
