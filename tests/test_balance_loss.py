"""The global-batch balance loss (balance_loss='global_batch'): f over the optimizer step's micro-batches so far,
P over the call's tokens; the layer equals the reference, the reference equals a float64 NumPy formula, and the
trainer feeds each micro-batch the counts of the earlier ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import mlm
from moejax.models import state as state_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests import helpers

CASES = [("topk", "flat", 2), ("node_limited", "gpu_first", 2), ("bilevel", "node_first", 1)]


def _config(routing, path, k, **fields):
  return MoEConfig(
    num_experts=16,
    top_k=k,
    d_model=8,
    d_ff=12,
    routing=routing,
    path=path,
    num_nodes=2,
    node_top_k=1,
    balance_loss="global_batch",
    load_balance_coef=0.01,
    z_loss_coef=1e-3,
    **fields,
  )


def _prior(cfg, seed):
  """Counts of earlier micro-batches: whole numbers, skewed towards the first entries."""
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 40, cfg.balance_counts_size) * np.linspace(3, 1, cfg.balance_counts_size)).round()


@pytest.mark.parametrize("routing,path,k", CASES)
@pytest.mark.sampled(1)
def test_layer_equals_reference_with_earlier_counts(mesh_2x4, routing, path, k):
  cfg = _config(routing, path, k)
  params, x = helpers.random_params(cfg, 3), helpers.normal(4, (64, 8))
  prior = _prior(cfg, 5).astype(np.float32)
  _, aux = helpers.assert_matches_reference(cfg, mesh_2x4, params, x, balance_counts=prior)
  assert aux["balance_counts"].sum() == prior.sum() + 64 * cfg.choices_per_token * (1 if routing != "bilevel" else 2)
  # Skewed: every token to expert 13 (flat routers); the counts and the loss follow.
  if routing == "topk":
    params, x = helpers.force_routing(params, x, [13, 2])
    _, aux = helpers.assert_matches_reference(cfg, mesh_2x4, params, x, balance_counts=prior)
    np.testing.assert_array_equal(np.asarray(aux["balance_counts"]) - prior, np.bincount([13, 2] * 64, minlength=16))


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.slow
def test_reference_is_switchs_formula_over_the_step_in_float64():
  """Flat top-2: alpha * E * sum_e (prior_e + c_e) / (sum prior + T K) * P_e, P the call's mean probability."""
  cfg = _config("topk", "flat", 2)
  params, x = helpers.random_params(cfg, 7), helpers.normal(8, (48, 8))
  prior = _prior(cfg, 9)
  _, aux = jax.jit(lambda p, x, c: moe_reference(p, x, cfg, balance_counts=c))(params, x, prior.astype(np.float32))
  probs = _softmax(x.astype(np.float64) @ params["router"]["kernel"].astype(np.float64))
  counts = np.bincount(np.argsort(-probs, axis=1)[:, :2].ravel(), minlength=16)
  f = (prior + counts) / (prior.sum() + 48 * 2)
  want = 0.01 * 16 * np.sum(f * probs.mean(0))
  np.testing.assert_allclose(float(aux["load_balance_loss"]), want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(aux["balance_counts"]), prior + counts)
  # With no earlier micro-batch it is the per-batch loss.
  _, batch = moe_reference(params, x, dataclasses.replace(cfg, balance_loss="batch"))
  _, first = moe_reference(params, x, cfg)
  np.testing.assert_allclose(float(first["load_balance_loss"]), float(batch["load_balance_loss"]), rtol=1e-6)


def test_bad_counts_and_sequence_with_bilevel_are_refused(mesh_2x4):
  cfg = _config("topk", "flat", 2)
  params, x = helpers.random_params(cfg, 1), helpers.normal(2, (64, 8))
  with pytest.raises(ConfigError, match=r"balance_counts.*\[16\]"):
    moe_apply(params, x, cfg, mesh_2x4, balance_counts=np.zeros(5, np.float32))
  with pytest.raises(ConfigError, match="balance_counts.*global_batch"):
    moe_apply(
      params, x, dataclasses.replace(cfg, balance_loss="batch"), mesh_2x4, balance_counts=np.zeros(16, np.float32)
    )
  with pytest.raises(ConfigError, match="balance_loss"):
    MoEConfig(num_experts=16, top_k=1, d_model=8, d_ff=12, routing="bilevel", num_nodes=2, balance_loss="sequence")


@pytest.mark.slow
def test_trainer_feeds_each_micro_batch_the_earlier_counts(devices):
  """Two micro-batches: the step's aux loss is the mean of the first's (no earlier counts) and the second's
  (the first's counts), recomputed here through the model with the counts set by hand."""
  config = mlm.get_config()
  config.model.update(kind="gpt", num_layers=2, moe_every=1)
  config.seq_len = 32
  config.moe.update(capacity_factor=None, top_k=2, balance_loss="global_batch", load_balance_coef=0.1)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), tok, donate=False)
  state, rest = trainer.init()
  tokens = np.random.default_rng(0).integers(2, 256, (config.micro_batches, 8, config.seq_len), np.int32)
  _, metrics = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))

  counts = np.zeros((2, trainer.moe_cfg.balance_counts_size), np.float32)
  losses = []
  for micro in tokens:
    model = nnx.merge(trainer.graphdef, state["params"], state_lib.with_balance_counts(trainer.model_cfg, rest, counts))
    inputs = trainer.targets(None, jnp.asarray(micro))[0]
    _, aux = model(inputs)
    losses.append(float(aux["aux_loss"]))
    counts = np.asarray(aux["balance_counts"])
  assert counts.sum() == 2 * config.micro_batches * inputs.size * 2  # 2 layers, every input token, top-2
  np.testing.assert_allclose(float(metrics["aux_loss"]), np.mean(losses), rtol=1e-5)
  # and the second micro-batch's loss differs from its per-batch loss (the counts matter)
  per_batch = nnx.merge(trainer.graphdef, state["params"], rest)  # zero earlier counts
  assert abs(float(per_batch(inputs)[1]["aux_loss"]) - losses[1]) > 1e-6
