"""Two-micro-batch overlap without a pipeline (pipeline.schedule='two_batch', `moejax.pipeline.two_batch`): the
trainer's step with each micro-batch's halves interleaved through the layers against the plain step of twice the
micro-batches, micro-batch 2i the even rows of micro-batch i and 2i + 1 its odd rows (fp32, 2 x 4 devices, fresh
random tokens, a balance loss weighing 0.1): every metric, every gradient (AdamW's first moment after one step) and
the parameters after it (to 1e-4); and the section's refusals naming their fields."""

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
MICRO, ROWS, SEQ = 2, 16, 16  # the two-batch step's micro-batches of 16 rows: 2 a device, one a half


def _config(spec: str, micro: int, schedule: str = "none", **moe):
  config = decoder.get_config(spec)
  config.update(batch_size=MICRO * ROWS, micro_batches=micro, seq_len=SEQ)
  config.moe.update(load_balance_coef=0.1, **moe)
  config.optim.warmup_steps = 1
  config.pipeline.schedule = schedule
  return config


def _one_step(config, tokens):
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), TOK, donate=False)
  state, rest = trainer.init()
  state, metrics = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))
  return jax.device_get(metrics), jax.device_get(state)


@pytest.mark.slow  # two compiled steps a family (about 40 s on 2 cores)
@pytest.mark.parametrize("spec", ["qwen3_moe", "deepseek_v3"])
def test_two_batch_step_equals_the_plain_step(devices, spec):
  """Qwen3-MoE: its balance loss over each call's tokens; DeepSeek-V3: per sequence, its dense first layer, the MTP
  module (an MoE block after the layers), the loss-free balancing bias updated from the summed counts."""
  tokens = np.random.default_rng(7).integers(TOK.first_ordinary, TOK.num_ids, (MICRO, ROWS, SEQ), np.int32)
  halves = tokens.reshape(MICRO, ROWS // 2, 2, SEQ).transpose(0, 2, 1, 3).reshape(2 * MICRO, ROWS // 2, SEQ)
  got, got_state = _one_step(_config(spec, MICRO, "two_batch"), tokens)
  want, want_state = _one_step(_config(spec, 2 * MICRO), halves)
  assert set(got) == set(want) and "aux_loss" in want and (spec != "deepseek_v3" or "mtp_loss" in want)
  for name in want:
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64), np.asarray(want[name], np.float64), rtol=2e-5, atol=1e-7, err_msg=name
    )
  # AdamW's moments: (1 - b1) x the gradient and (1 - b2) x its square, to 1e-7; the parameters after the update to
  # 1e-4 (lr 3e-3: AdamW's first step moves a parameter by lr x g / (|g| + eps) whatever its gradient's size, so a
  # gradient near eps shows its fp32 rounding there: 3.0e-5 on one of 65,536 of DeepSeek-V3's on an AMD EPYC host).
  for key, atol in (("opt_state", 1e-7), ("params", 1e-4)):
    jax.tree.map(
      lambda g, w, atol=atol, key=key: np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol, err_msg=key),
      got_state[key],
      want_state[key],
    )


@pytest.mark.parametrize(
  "field,value,fields",
  [
    ("pipeline.stages", 2, dict(stages=2)),
    ("moe.balance_loss", "global_batch", dict(balance_loss="global_batch")),
    ("batch_size", 24, dict(batch_size=24)),  # 12 rows a micro-batch: not 2 x 8 devices' multiple
  ],
)
def test_refusals_name_the_field(field, value, fields):
  config = _config("qwen3_moe", MICRO, "two_batch")
  config.pipeline.stages = fields.pop("stages", 1)
  config.moe.update({k: v for k, v in fields.items() if k == "balance_loss"})
  config.update({k: v for k, v in fields.items() if k == "batch_size"})
  with pytest.raises(ConfigError) as refused:
    config_lib.checked(config)
  assert refused.value.field == field and refused.value.value == value


def test_the_cost_model_and_the_docs_name_the_trainers_schedule():
  """`cost.one_device(..., two_batch=True)` prices the step pipeline.schedule names, and docs/pipelines.md's cost
  table lists it by that name."""
  from moejax.pipeline import cost, two_batch

  priced = cost.one_device(4, cost.StageCost(f=1.0, b=2.0, w=1.0, a2a_f=0.5, a2a_b=0.5), two_batch=True)
  assert priced.name == two_batch.SCHEDULE == "two_batch"
  assert f"| {two_batch.SCHEDULE} | " in (ROOT / "docs" / "pipelines.md").read_text()
