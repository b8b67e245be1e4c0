"""Training the decoder families: the trainer's step on Qwen3-MoE- and DeepSeek-V3-shaped decoders (DeepSeek's MTP
module on), the MTP loss against float64 NumPy, and the family configs' errors naming their fields."""

import sys

import jax
import numpy as np
import pytest

from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT))
from configs import decoder  # noqa: E402

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


def test_multi_token_loss_matches_numpy():
  """Module k at position i predicts token i + k + 2: the mean over modules of each one's mean cross-entropy over
  the positions that have such a token (float64 loops)."""
  rng = np.random.default_rng(0)
  k_modules, b, s, v = 2, 3, 7, 11
  logits = rng.normal(size=(k_modules, b, s, v)).astype(np.float32)
  tokens = rng.integers(0, v, (b, s)).astype(np.int32)
  _, _, targets, weights = objective.next_token(jax.numpy.asarray(tokens), pad_id=0)
  got = float(objective.multi_token_loss(jax.numpy.asarray(logits), targets, weights))
  want = []
  for k in range(k_modules):
    losses = []
    for row in range(b):
      for i in range(s - k - 2):
        z = logits[k, row, i].astype(np.float64)
        losses.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[tokens[row, i + k + 2]])
    want.append(np.mean(losses))
  np.testing.assert_allclose(got, np.mean(want), rtol=1e-5)


def _config(spec: str):
  config = decoder.get_config(spec)
  config.update(batch_size=8, micro_batches=1, seq_len=32)
  config.optim.update(warmup_steps=2)
  return config


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["qwen3_moe", "deepseek_v3"])
def test_trainer_trains_the_family(devices, spec):
  """Ten steps on one fixed batch of random tokens on the 2 x 4 mesh: the task loss falls (the model memorises),
  with DeepSeek-V3's MTP loss recorded and falling too, and every parameter (the MTP module's included) moving."""
  config = _config(spec)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), TOK, donate=False)
  state, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(TOK.first_ordinary, TOK.num_ids, (1, 8, config.seq_len), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  first = state
  records = []
  for _ in range(10):
    state, metrics = trainer.step(state, rest, batch)
    records.append(jax.device_get(metrics))
  losses = [float(r["task_loss"]) for r in records]
  assert losses[-1] < losses[0] - 0.2 and all(np.diff(losses) < 0), losses
  if spec == "deepseek_v3":
    mtp = [float(r["mtp_loss"]) for r in records]
    assert np.isfinite(mtp).all() and mtp[-1] < mtp[0] - 0.1, mtp
    np.testing.assert_allclose(float(records[0]["loss"]), float(records[0]["task_loss"] + records[0]["aux_loss"])
                               + trainer.model_cfg.mtp_loss_coef * mtp[0], rtol=1e-5)
  else:
    assert "mtp_loss" not in records[0]
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), first["params"], state["params"])
  still = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_flatten_with_path(moved)[0] if not m]
  assert not still, still


@pytest.mark.parametrize("field,value,named", [
    ("model.family", "gpt4", "model.family"), ("model.num_kv_heads", 3, "model.num_kv_heads"),
    ("model.moe_layers", (True,), "model.moe_layers"), ("moe.d_model", 64, "moe.d_model"),
    ("model.d_modell", 64, "model.d_modell")])
def test_family_config_errors_name_the_field(field, value, named):
  config = _config("deepseek_v3")
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
    config_lib.validate(config)


@pytest.mark.slow
def test_mtp_moe_layer_loads_are_counted_and_balance_its_bias(devices):
  """DeepSeek-V3's MTP module has an MoE layer of its own: its loads come after the blocks' in the step's
  expert_counts (every token-choice of the batch routed once there), and its balancing bias is updated from them
  by u * sign(mean - load) like every other layer's."""
  config = _config("deepseek_v3")
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), TOK, donate=False)
  model_cfg, moe_cfg = trainer.model_cfg, trainer.moe_cfg
  moe_layers = model_cfg.num_moe_layers + model_cfg.num_mtp_layers
  assert model_cfg.num_mtp_layers == 1 and moe_cfg.bias_update_rate > 0
  state, rest = trainer.init()
  assert state["expert_bias"].shape == (moe_layers, moe_cfg.num_experts)
  tokens = np.random.default_rng(2).integers(TOK.first_ordinary, TOK.num_ids, (1, 8, config.seq_len), np.int32)
  before = np.asarray(state["expert_bias"])
  state, metrics = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))
  counts = np.asarray(metrics["expert_counts"])
  assert counts.shape == (moe_layers, moe_cfg.num_experts)
  assert np.all(counts.sum(axis=1) == 8 * config.seq_len * moe_cfg.top_k)  # the MTP layer's row too
  load = counts.astype(np.float64)
  want = before + moe_cfg.bias_update_rate * np.sign(load.mean(axis=1, keepdims=True) - load)
  np.testing.assert_allclose(np.asarray(state["expert_bias"]), want, atol=1e-9)
  assert np.any(np.asarray(state["expert_bias"])[-1] != 0)
