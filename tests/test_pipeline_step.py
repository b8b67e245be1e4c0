"""The pipelined loss and gradients, run from the gpipe and 1f1b timetables over a 'stage' mesh axis, against the
unpipelined jax.grad of the same stacked layers (fp32, fresh random draws)."""

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


def _reference(params, x_UxBxD, targets_UxBxD):
  def one(x_BxD, target_BxD):
    for s in range(params["w"].shape[0]):
      x_BxD = _stage(jax.tree.map(lambda leaf: leaf[s], params), x_BxD)
    return _loss(x_BxD, target_BxD)
  return jnp.mean(jax.vmap(one)(x_UxBxD, targets_UxBxD))


@pytest.mark.parametrize("schedule,stages,micro_batches", [("gpipe", 4, 4), ("1f1b", 4, 8), ("1f1b", 8, 4),
                                                           ("gpipe", 2, 8)])
def test_pipelined_loss_and_grads_equal_the_unpipelined(devices, schedule, stages, micro_batches):
  keys = jax.random.split(jax.random.key(stages * 100 + micro_batches), 4)
  d, b = 16, 3
  params = {"w": jax.random.normal(keys[0], (stages, d, d)) / np.sqrt(d), "b": jax.random.normal(keys[1], (stages, d))}
  x = jax.random.normal(keys[2], (micro_batches, b, d))
  targets = jax.random.normal(keys[3], (micro_batches, b, d))
  mesh = Mesh(np.asarray(devices[:stages]), ("stage",))
  loss, grads = jax.jit(lambda p, x, t: step.pipelined_loss_and_grads(_stage, _loss, p, x, t, mesh, schedule))(
      params, x, targets)
  ref_loss, ref_grads = jax.value_and_grad(_reference)(params, x, targets)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for name in params:
    np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)


def test_tick_table_and_refusals():
  """Each F's output arrives at the next stage in the tick it runs; schedules the step cannot run are named."""
  ticks = step.tick_table("1f1b", 4, 8)
  kind, mb, arrives_f = ticks[0], ticks[1], ticks[2]
  for t, d in zip(*np.nonzero(kind == step.FORWARD)):
    if d < 3:
      assert arrives_f[t, d + 1] == mb[t, d]
  with pytest.raises(ConfigError, match="config field schedule='dualpipe'"):
    step.tick_table("dualpipe", 4, 8)
