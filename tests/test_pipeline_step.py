"""The pipelined loss and gradients, run from the gpipe and 1f1b timetables over a 'stage' mesh axis, against the
unpipelined jax.grad of the same stacked layers (fp32, fresh random draws): a shared parameter on the first stage,
one layer a stage, the loss on the last, the statistics per stage and micro-batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from moejax.pipeline import step
from moejax.validation import ConfigError


def _stage(params, x_BxD):
  return jnp.tanh(x_BxD @ params["w"] + params["b"]) + x_BxD


def _loss(y_BxD, target_BxD):
  return jnp.mean((y_BxD - target_BxD) ** 2)


def _reference(params, scale, x_UxBxD, targets_UxBxD):
  def one(x_BxD, target_BxD):
    x_BxD = x_BxD * scale
    for s in range(params["w"].shape[0]):
      x_BxD = _stage(jax.tree.map(lambda leaf: leaf[s], params), x_BxD)
    return _loss(x_BxD, target_BxD)
  return jnp.sum(jax.vmap(one)(x_UxBxD, targets_UxBxD))


# The toy as pipeline stages: the first scales the input by a shared parameter, each stage one layer (its slice
# [1, ...]), the last takes the loss; statistics: the first's input norm, the stage's output norm, the loss.
TOY = step.Stages(
    first=lambda w, batch: (batch["x"] * w.shared, jnp.zeros(()), jnp.sum(batch["x"] ** 2)),
    stage=lambda w, x, batch: ((y := _stage(jax.tree.map(lambda leaf: leaf[0], w.staged), x)), jnp.zeros(()),
                               jnp.sum(y ** 2)),
    last=lambda w, y, batch: ((loss := _loss(y, batch["target"])), loss))


@pytest.mark.parametrize("schedule,stages,micro_batches", [("gpipe", 4, 4), ("1f1b", 4, 8), ("1f1b", 8, 4),
                                                           ("gpipe", 2, 8)])
def test_pipelined_loss_and_grads_equal_the_unpipelined(devices, schedule, stages, micro_batches):
  keys = jax.random.split(jax.random.key(stages * 100 + micro_batches), 4)
  d, b = 16, 3
  params = {"w": jax.random.normal(keys[0], (stages, d, d)) / np.sqrt(d), "b": jax.random.normal(keys[1], (stages, d))}
  x = jax.random.normal(keys[2], (micro_batches, b, d))
  targets = jax.random.normal(keys[3], (micro_batches, b, d))
  scale = 1.0 + jax.random.uniform(keys[0], ())
  mesh = Mesh(np.asarray(devices[:stages]), ("stage",))
  run = lambda p, s, x, t: step.pipelined_loss_and_grads(TOY, step.Weights(p, s), {"x": x, "target": t}, mesh,
                                                         schedule)
  loss, (grads, dscale), (first_U, stage_PxU, last_U) = jax.jit(run)(params, scale, x, targets)
  ref_loss, (ref_grads, ref_dscale) = jax.value_and_grad(_reference, argnums=(0, 1))(params, scale, x, targets)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(dscale, ref_dscale, rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(first_U, np.sum(np.asarray(x) ** 2, axis=(1, 2)), rtol=1e-5)
  np.testing.assert_allclose(np.sum(last_U), ref_loss, rtol=1e-6)
  y = x * scale
  for s in range(stages):  # each stage's statistics at its row, per micro-batch
    y = jax.vmap(lambda v, s=s: _stage(jax.tree.map(lambda leaf: leaf[s], params), v))(y)
    np.testing.assert_allclose(stage_PxU[s], np.sum(np.asarray(y) ** 2, axis=(1, 2)), rtol=1e-5)


def test_tick_table_and_refusals():
  """Each F's output arrives at the next stage in the tick it runs; schedules the step cannot run are named."""
  ticks = step.tick_table("1f1b", 4, 8)
  kind, mb, arrives_f = ticks[0], ticks[1], ticks[2]
  for t, d in zip(*np.nonzero(kind == step.FORWARD)):
    if d < 3:
      assert arrives_f[t, d + 1] == mb[t, d]
  for schedule in ("interleaved", "dualpipe", "dualpipev"):  # refused with what the step lacks for them
    with pytest.raises(ConfigError, match=f"config field schedule='{schedule}'") as refused:
      step.tick_table(schedule, 4, 8)
    assert step.MISSING[schedule] in str(refused.value)
