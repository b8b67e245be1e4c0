"""The pipelined loss and gradients, run from each schedule's timetable over a 'stage' mesh axis, against the
unpipelined jax.grad of the same stacked layers (fp32, fresh random draws): a shared parameter on the first stage,
one layer a stage (dualpipev: 2p stages on p devices, the V; interleaved: p v; dualpipe: p, each on two devices),
the loss on the last, the statistics per stage and micro-batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from moejax.pipeline import schedules, step, ticks
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
  stage=lambda w, x, batch: (
    (y := _stage(jax.tree.map(lambda leaf: leaf[0], w.staged), x)),
    jnp.zeros(()),
    jnp.sum(y**2),
  ),
  last=lambda w, y, batch: ((loss := _loss(y, batch["target"])), loss),
)


@pytest.mark.parametrize(
  "schedule,devices_,micro_batches,virtual",
  [
    ("gpipe", 4, 4, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 8, 4, 1),
    ("gpipe", 2, 8, 1),
    ("dualpipev", 2, 4, 1),
    ("dualpipev", 4, 8, 1),
    ("dualpipe", 4, 8, 1),
    ("interleaved", 2, 4, 2),
  ],
)
@pytest.mark.sampled(1)
def test_pipelined_loss_and_grads_equal_the_unpipelined(devices, schedule, devices_, micro_batches, virtual):
  stages = schedules.of(schedule).layer_stages(devices_, virtual)
  keys = jax.random.split(jax.random.key(stages * 100 + micro_batches), 4)
  d, b = 16, 3
  params = {"w": jax.random.normal(keys[0], (stages, d, d)) / np.sqrt(d), "b": jax.random.normal(keys[1], (stages, d))}
  x = jax.random.normal(keys[2], (micro_batches, b, d))
  targets = jax.random.normal(keys[3], (micro_batches, b, d))
  scale = 1.0 + jax.random.uniform(keys[0], ())
  mesh = Mesh(np.asarray(devices[:devices_]), ("stage",))
  run = lambda p, s, x, t: step.pipelined_loss_and_grads(
    TOY, step.Weights(p, s), {"x": x, "target": t}, mesh, schedule, virtual_stages=virtual
  )
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


def _picked_stage(params, x_BxD, pick_B):
  """A stage passing an int32 choice on beside x, as GLM-5's shared DSA layers do: each row adds its column
  pick_B of x (the previous stage's choice), then chooses its largest column for the next."""
  picked_Bx1 = jnp.take_along_axis(x_BxD, pick_B[:, None], axis=1)
  y_BxD = _stage(params, x_BxD) + 0.5 * picked_Bx1
  return y_BxD, jnp.argmax(y_BxD, axis=1).astype(jnp.int32)


def _picked_reference(params, scale, x_UxBxD, targets_UxBxD):
  def one(x_BxD, target_BxD):
    x_BxD, pick_B = x_BxD * scale, jnp.zeros(x_BxD.shape[:1], jnp.int32)
    for s in range(params["w"].shape[0]):
      x_BxD, pick_B = _picked_stage(jax.tree.map(lambda leaf: leaf[s], params), x_BxD, pick_B)
    return _loss(x_BxD, target_BxD)

  return jnp.sum(jax.vmap(one)(x_UxBxD, targets_UxBxD))


# The activation a pytree {x, pick}: pick (int32) goes forward only, x's gradient comes back.
PICKED = step.Stages(
  first=lambda w, batch: (
    {"x": batch["x"] * w.shared, "pick": jnp.zeros(batch["x"].shape[:1], jnp.int32)},
    jnp.zeros(()),
    jnp.zeros(()),
  ),
  stage=lambda w, a, batch: (
    dict(zip(("x", "pick"), _picked_stage(jax.tree.map(lambda leaf: leaf[0], w.staged), a["x"], a["pick"]))),
    jnp.zeros(()),
    jnp.zeros(()),
  ),
  last=lambda w, a, batch: ((loss := _loss(a["x"], batch["target"])), loss),
)


@pytest.mark.parametrize("schedule,devices_,micro_batches", [("1f1b", 4, 4), ("dualpipev", 2, 4), ("dualpipe", 4, 8)])
@pytest.mark.sampled(1)
def test_an_activation_with_an_int_leaf_goes_forward_and_its_float_gradient_back(
  devices, schedule, devices_, micro_batches
):
  """A pytree activation whose int32 leaf the next stage reads: the loss and gradients equal jax.grad of the
  unpipelined stages (fp32), on draws where the choices differ between rows and stages."""
  stages = schedules.of(schedule).layer_stages(devices_)
  keys = jax.random.split(jax.random.key(7 * stages + micro_batches), 4)
  d, b = 8, 3
  params = {"w": jax.random.normal(keys[0], (stages, d, d)) / np.sqrt(d), "b": jax.random.normal(keys[1], (stages, d))}
  x = jax.random.normal(keys[2], (micro_batches, b, d))
  targets = jax.random.normal(keys[3], (micro_batches, b, d))
  scale = 1.5
  picks = jnp.argmax(
    jax.vmap(lambda v: _picked_stage(jax.tree.map(lambda l: l[0], params), v * scale, jnp.zeros(b, jnp.int32))[0])(x),
    axis=-1,
  )
  assert len(np.unique(np.asarray(picks))) > 1  # the choice differs between rows: reading it matters
  mesh = Mesh(np.asarray(devices[:devices_]), ("stage",))
  run = lambda p, s, x, t: step.pipelined_loss_and_grads(
    PICKED, step.Weights(p, s), {"x": x, "target": t}, mesh, schedule
  )
  loss, (grads, dscale), _ = jax.jit(run)(params, scale, x, targets)
  ref_loss, (ref_grads, ref_dscale) = jax.value_and_grad(_picked_reference, argnums=(0, 1))(params, scale, x, targets)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(dscale, ref_dscale, rtol=1e-5)
  for name in params:
    largest = float(np.max(np.abs(ref_grads[name])))  # fp32 sums reordered: errors relative to the gradient's size
    np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-5, atol=1e-5 * largest)


def test_plan_of_dualpipev():
  """The V on 2 devices: device d runs stages d and 3-d; device 1 turns each forward from chunk 0 to chunk 1 on
  itself (a link of shift 0) and each backward back; paired F&B slots run in one tick; every F's output arrives
  where its route goes next, in the tick it runs."""
  the = ticks.plan("dualpipev", 2, 4)
  np.testing.assert_array_equal(the.stage_of, [[0, 3], [1, 2]])
  np.testing.assert_array_equal(the.layout(8), [0, 1, 6, 7, 2, 3, 4, 5])
  assert {(kind, shift) for kind, shift, _ in the.links} == {
    ("F", 1),
    ("F", 0),
    ("F", -1),
    ("B", 1),
    ("B", 0),
    ("B", -1),
  }
  ops = the.ticks[:, :, :2, 0]
  assert ((ops >= 0).sum(axis=2) == 2).any()  # some tick runs a forward and a backward
  route = [(0, 0), (1, 0), (1, 1), (0, 1)]
  for t, d in zip(*np.nonzero(ops[:, :, 0] >= 0)):
    mb, c = the.ticks[t, d, 0]
    k = route.index((d, c))
    if k < 3:
      to, c2 = route[k + 1]
      link = [i for i, (kind, shift, _) in enumerate(the.links) if (kind, shift) == ("F", to - d)][0]
      assert tuple(the.ticks[t, to, 2 + link]) == (mb, c2)


def test_refusals():
  """A schedule the step does not know is named."""
  with pytest.raises(ConfigError, match="config field schedule='zb-v'"):
    ticks.plan("zb-v", 4, 8)
