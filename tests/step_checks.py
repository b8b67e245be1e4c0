"""A training step through a pipeline or the two-batch step against the plain step, on 1 x 4 devices (x stages):
shared by the tests of the features that travel through the stages (GLM-5's shared layers, hash routing)."""

import jax
import numpy as np

from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


def one_step(config, stages: int, tokens):
  """(metrics, optimizer state) after one step of `config` from its init; tokens [U, B/U, S]."""
  mesh = mesh_lib.make_mesh(1, 4, stages=stages)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh, TOK, donate=False)
  state, rest = trainer.init()
  state, metrics = trainer.step(state, rest, jax.device_put(tokens, trainer.batch_sharding))
  return jax.device_get(metrics), jax.device_get(state["opt_state"])


def check_equals_the_plain_step(config_of, schedule: str, stages: int, micro: int) -> None:
  """config_of(micro, pipeline section fields) -> a config of 16 rows of 16 tokens in `micro` micro-batches. The
  step's metrics and every gradient (AdamW's first moment) through `schedule` equal the plain step's; the two-batch
  step's equal the plain step's over the halves as micro-batches (`tests/test_two_batch.py`)."""
  tokens = np.random.default_rng(5).integers(TOK.first_ordinary, TOK.num_ids, (micro, 16 // micro, 16), np.int32)
  got, got_moments = one_step(config_of(micro, dict(schedule=schedule, stages=stages)), stages, tokens)
  if schedule == "two_batch":  # micro-batch 2i: micro-batch i's even rows, 2i + 1 its odd ones
    tokens, micro = tokens.reshape(micro, 4, 2, 16).transpose(0, 2, 1, 3).reshape(2 * micro, 4, 16), 2 * micro
  want, want_moments = one_step(config_of(micro, {}), 1, tokens)
  assert set(got) == set(want) and np.isfinite(want["loss"])
  for name in want:
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64), np.asarray(want[name], np.float64), rtol=2e-5, atol=1e-6, err_msg=name
    )
  for got_leaf, want_leaf in zip(jax.tree.leaves(got_moments), jax.tree.leaves(want_moments)):
    np.testing.assert_allclose(np.asarray(got_leaf, np.float64), np.asarray(want_leaf, np.float64), atol=1e-7)
