"""Auxiliary-loss-free balancing in training: the bias [M, E] carried in the train state, updated in the step
by DeepSeek-V3's rule from the step's loads, passed to the layers' routing only; and the published-layer
presets train at small scale. (That the bias survives a kill and resume bit-identically is test_train's
kill-and-resume test, which runs with it.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import mlm, moe_preset
from moejax.models import presets
from moejax.models import state as state_lib
from moejax.models.config import moe_block_indices
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import metrics, objective
from moejax.train import trainer as train
from tests.helpers import normal

# slow: training runs with the balancing bias; one xdist worker runs the module, so its module fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("expert_bias")]

RATE = 0.01
STEPS = 30
TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


def _config(rate):
  """A tiny causal decoder, 2 MoE layers of 8 experts, top-2, dropless, 2 micro-batches per step."""
  config = mlm.get_config()
  config.model.update(kind="gpt", num_layers=4)
  config.seq_len = 32
  config.moe.update(capacity_factor=None, top_k=2, bias_update_rate=rate)
  return config


def _steps(rate, steps=STEPS):
  """Runs `steps` steps of random tokens; returns (trainer, rest, states before each step and the last, metrics)."""
  config = _config(rate)
  # 2 x 1: routing is per token and dropless, so the loads are the 2 x 4 mesh's, each step half the cost.
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 1), TOK, donate=False)
  state, rest = trainer.init()
  rng = np.random.default_rng(0)
  states, records = [state], []
  for _ in range(steps):
    tokens = rng.integers(TOK.first_ordinary, TOK.num_ids, (config.micro_batches, 8, config.seq_len), np.int32)
    state, m = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))
    states.append(state)
    records.append(dict(jax.device_get(m), tokens=tokens))
  return trainer, rest, states, records


@pytest.fixture(scope="module")
def biased(devices):
  return _steps(RATE)


def test_bias_follows_the_update_rule_on_the_measured_loads(biased):
  trainer, _, states, records = biased
  assert "expert_bias" not in str(jax.tree_util.tree_flatten_with_path(states[0]["params"])[0])  # never optimised
  assert "expert_bias" not in str(jax.tree_util.tree_flatten_with_path(states[0]["opt_state"])[0])
  bias = np.zeros((2, 8), np.float32)  # NumPy replay of b += u * sign(mean load - load) on the recorded counts
  np.testing.assert_array_equal(np.asarray(states[0]["expert_bias"]), bias)
  for state, record in zip(states[1:], records):
    counts = np.asarray(record["expert_counts"], np.float64)
    assert counts.shape == (2, 8) and counts.sum() == 2 * 16 * 32 * 2  # both micro-batches: the step's load
    bias = (bias + np.float32(RATE) * np.sign(counts.mean(axis=1, keepdims=True) - counts)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(state["expert_bias"]), bias)
    np.testing.assert_array_equal(record["expert_bias_range"], bias.max(axis=1) - bias.min(axis=1))
  assert np.abs(bias).max() > 0 and (bias.max(axis=1) - bias.min(axis=1) > 0).all()  # the skewed run moved it


def test_trainer_routes_with_the_state_bias_and_never_weights_by_it(biased):
  trainer, rest, states, records = biased
  state, record = states[-2], records[-1]  # the last step ran on states[-2]'s bias
  bias = state["expert_bias"]
  assert np.abs(np.asarray(bias)).max() > 0

  def counts(bias_MxE):
    model = nnx.merge(
      trainer.graphdef, state["params"], state_lib.with_expert_biases(trainer.model_cfg, rest, bias_MxE)
    )
    return sum(np.asarray(model(jnp.asarray(micro))[1]["expert_counts"]) for micro in record["tokens"])

  np.testing.assert_array_equal(counts(bias), record["expert_counts"])  # the step's routing used the state's bias
  assert (counts(jnp.zeros_like(bias)) != record["expert_counts"]).any()  # and it matters

  model = nnx.merge(trainer.graphdef, state["params"], state_lib.with_expert_biases(trainer.model_cfg, rest, bias))
  layer = model.blocks[moe_block_indices(trainer.model_cfg)[1]].ffn.moe
  x = normal(3, (64, trainer.moe_cfg.d_model))
  y, aux = layer(x)
  y_ref, aux_ref = moe_reference(layer.params(), x, trainer.moe_cfg, expert_bias=np.asarray(bias)[1])
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(aux["expert_counts"], aux_ref["expert_counts"])
  y_unbiased, _ = moe_reference(layer.params(), x, trainer.moe_cfg)
  assert not np.allclose(y_ref, y_unbiased, rtol=1e-4, atol=1e-5)  # the bias changed some choices


def test_balancing_lowers_the_busiest_expert_load(biased):
  busiest = {
    rate: [metrics.busiest_expert_load(r["expert_counts"]) for r in records]
    for rate, records in ((0.0, _steps(0.0)[3]), (RATE, biased[3]))
  }
  late = {rate: float(np.mean(b[-10:])) for rate, b in busiest.items()}
  print(f"busiest expert load / mean over the last 10 of {STEPS} steps, without and with the bias:", late)
  assert busiest[0.0][0] == busiest[RATE][0]  # the first step routes with a zero bias
  assert late[RATE] < late[0.0] - 0.3


def _train_config(shared, steps, **preset):
  config = moe_preset.get_config() if preset else _config(RATE)
  config.update(preset)
  config.steps = steps
  config.data.cache_dir = str(shared / "cache")
  config.checkpoint.update(every_steps=2, use_async=False)
  config.log.update(tensorboard=False, every_steps=1)
  return config


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_trains_at_small_scale(shared, tmp_path, name):
  config = _train_config(shared, 2, preset=name)
  summary = train.train(config, str(tmp_path))
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert summary["steps"] == 2 and all(np.isfinite(r["loss"]) for r in records)
  moe_cfg = config_lib.validate(config)[1]
  fields = presets.PRESETS[name].moe
  for key in ("top_k", "score", "routed_scaling", "num_groups", "bias_update_rate", "num_shared_experts"):
    assert getattr(moe_cfg, key) == fields.get(key, getattr(type(moe_cfg), key, None)), key
  assert ("expert_bias_range" in records[-1]) == (fields.get("bias_update_rate", 0) > 0)


def test_presets_match_the_published_shapes():
  full = {name: presets.moe_fields(name) for name in presets.PRESETS}
  assert {
    k: full["deepseek_v3"][k]
    for k in (
      "d_model",
      "d_ff",
      "num_experts",
      "top_k",
      "num_groups",
      "topk_groups",
      "routed_scaling",
      "num_shared_experts",
    )
  } == dict(
    d_model=7168,
    d_ff=2048,
    num_experts=256,
    top_k=8,
    num_groups=8,
    topk_groups=4,
    routed_scaling=2.5,
    num_shared_experts=1,
  )
  assert (full["qwen3_moe"]["d_model"], full["qwen3_moe"]["d_ff"], full["qwen3_moe"]["num_experts"]) == (2048, 768, 128)
  from moejax.bench import kernel_cases  # the kernel benchmark's Mixtral shape is the same

  bench = kernel_cases.MODELS["mixtral_8x7b"]
  mixtral = full["mixtral_8x7b"]
  assert (
    mixtral["d_model"],
    mixtral["d_ff"],
    mixtral["num_experts"],
    mixtral["top_k"],
    mixtral["gated"],
    mixtral["activation"],
  ) == (bench["d"], bench["f"], bench["experts"], bench["top_k"], bench["gated"], bench["activation"])
  small = presets.moe_fields("deepseek_v3", 16, min_experts=8)  # 16 experts would leave 8 candidates = top-8
  assert (small["d_model"], small["d_ff"], small["num_experts"]) == (448, 128, 24)
  assert presets.moe_fields("deepseek_v3", 1, 64)["num_experts"] == 24  # not 8 groups of one (tests/test_presets.py)
