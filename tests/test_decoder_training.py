"""Training the decoder families: the trainer's step on Qwen3-MoE- and DeepSeek-V3-shaped decoders (DeepSeek's MTP
module on), the MTP loss against float64 NumPy, and the family configs' errors naming their fields."""

import jax
import numpy as np
import pytest

from configs import decoder
from moejax.models import lm_loss
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


def test_multi_token_loss_matches_numpy():
  """Module k at position i predicts token i + k + 2: the mean over modules of each one's mean cross-entropy over
  the positions that have such a token (float64 loops)."""
  rng = np.random.default_rng(0)
  k_modules, b, s, v = 2, 3, 7, 11
  logits = rng.normal(size=(k_modules, b, s, v)).astype(np.float32)
  tokens = rng.integers(0, v, (b, s)).astype(np.int32)
  _, _, targets, weights = objective.next_token(jax.numpy.asarray(tokens), pad_id=0)
  got = float(lm_loss.multi_token_loss(jax.numpy.asarray(logits), targets, weights))
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
@pytest.mark.parametrize("spec", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_trainer_trains_the_family(devices, spec):
  """Ten steps on one fixed batch of random tokens on the 2 x 4 mesh: the task loss falls (the model memorises),
  with DeepSeek-V3's MTP loss recorded and falling too, and every parameter (the MTP module's included) moving."""
  config = _config(spec)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), TOK, donate=False)
  state, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(TOK.first_ordinary, TOK.num_ids, (1, 8, config.seq_len), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  first = state
  records, biases = [], []
  for _ in range(10):
    state, metrics = trainer.step(state, rest, batch)
    records.append(jax.device_get(metrics))
    biases.append(np.asarray(state.get("expert_bias", 0.0)))
  losses = [float(r["task_loss"]) for r in records]
  assert losses[-1] < losses[0] - 0.2 and all(np.diff(losses) < 0), losses
  if spec == "deepseek_v3":
    mtp = [float(r["mtp_loss"]) for r in records]
    assert np.isfinite(mtp).all() and mtp[-1] < mtp[0] - 0.1, mtp
    np.testing.assert_allclose(
      float(records[0]["loss"]),
      float(records[0]["task_loss"] + records[0]["aux_loss"]) + trainer.model_cfg.mtp_loss_coef * mtp[0],
      rtol=1e-5,
    )
    # The MTP module's MoE layer is a layer of the state: its loads follow the blocks' (every token-choice of the
    # batch routed once there too), and its balancing bias moves by u * sign(mean - load) like the others'.
    moe_cfg, layers = trainer.moe_cfg, trainer.model_cfg.num_moe_layers + trainer.model_cfg.num_mtp_layers
    counts = np.asarray(records[1]["expert_counts"], np.float64)
    assert counts.shape == (layers, moe_cfg.num_experts) and trainer.model_cfg.num_mtp_layers == 1
    assert np.all(counts.sum(axis=1) == 8 * config.seq_len * moe_cfg.top_k)
    want = biases[0] + moe_cfg.bias_update_rate * np.sign(counts.mean(axis=1, keepdims=True) - counts)
    np.testing.assert_allclose(biases[1], want, atol=1e-9)
    assert np.any(biases[1][-1] != biases[0][-1])
  else:
    assert "mtp_loss" not in records[0]
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), first["params"], state["params"])
  still = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_flatten_with_path(moved)[0] if not m]
  assert not still, still


@pytest.mark.parametrize(
  "field,value,named",
  [
    ("model.family", "gpt4", "model.family"),
    ("model.num_kv_heads", 3, "model.num_kv_heads"),
    ("model.moe_layers", (True,), "model.moe_layers"),
    ("moe.d_model", 64, "moe.d_model"),
    ("model.d_modell", 64, "model.d_modell"),
  ],
)
def test_family_config_errors_name_the_field(field, value, named):
  config = _config("deepseek_v3")
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
    config_lib.validate(config)
