"""A pipelined loss and gradient, run from a schedule's timetable: stages over a mesh axis, activations and their
gradients moved by `jax.lax.ppermute` inside `jax.shard_map`, the ticks of the timetable in one `jax.lax.scan`.

A model is three functions (`Stages`): `first` on the first stage (the embeddings: micro-batch -> activation),
`stage` on every stage (its slice of the layers: activation -> activation) and `last` on the last (the head and the
loss). Each also returns a loss term (summed into the loss: the MoE layers' auxiliary losses, the task loss) and
statistics (summed per micro-batch, not differentiated: expert counts, ...). The staged parameters (leaves [n, ...],
stage k's slice rows k n/S .. (k+1) n/S - 1 of the schedule's S stages) are cut into chunks: a device holds one chunk
per stage it runs (gpipe, 1f1b: stage d on device d; interleaved: stages d, d+p, ...; dualpipev: stages d and
2p-1-d, the V; dualpipe: stages d and p-1-d, a second copy of every stage). The step lays them out so
(`ticks.Plan.layout`: a permutation of the stacked slices, repeating a slice for dualpipe, sharded over the axis),
and sums the gradients back into the leaves' own layout. The shared parameters (the embeddings, the head) are
replicated over the axis, their gradients summed over it; each parameter's non-differentiated state (slot tables, balancing biases) goes with it.

At tick t each device runs the slot its timetable starts then (`ticks.TICKS`: every slot one tick, a paired F&B slot
too): F(i) runs its chunk on micro-batch i's input (the first stage `first` of the micro-batch, the others what
their predecessor sent) and keeps that input; B(i) recomputes the chunk's vjp at the kept input (the stage
rematerialised) with the output's gradient (the last stage's output feeds its own loss: none), adds the parameters'
gradients and sends the input's back; a paired slot runs both (one micro-batch's forward, another's backward, on
its two chunks). A split-off W is no slot here: B computes the whole backward. The loss is recorded at the last
stage's B, once, a chunk's statistics at the micro-batch's F (the last stage's at its B, again by B elsewhere: the
same values). A chunk also reads `Weights.before`, its statistics of the micro-batches before the running one
summed: every schedule runs a chunk's forwards (the last stage's backwards) in micro-batch order, so they are
recorded by then (a balance loss over the step's earlier micro-batches; dualpipe's second copy runs the second half
of the micro-batches, so a chunk holds only its own half's). After each tick one ppermute per link
(`ticks.Plan.links`: the F outputs, or the B input-gradients, that go the same way, e.g. down the V and back up
it) carries what the slot sends to the device holding the next (previous) stage; a link to the device itself (the
V's turn from chunk 0 to chunk 1 on the last device) is no transfer. The receiver files it under the (micro-batch, chunk) the timetable says.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.pipeline import ticks as ticks_lib
from moejax.pipeline.timetable import F
from moejax.validation import require


class Weights(NamedTuple):
  """What the stages read: staged (leaves [n, ...], split over the stages) and shared (replicated) parameters, the
  gradients' arguments, and their non-differentiated state alike (staged_rest [n, ...], shared_rest)."""

  staged: object
  shared: object
  staged_rest: object = None
  shared_rest: object = None
  before: object = None  # (first's, stage's, last's) statistics of this chunk's earlier micro-batches, summed
  stage: object = None  # the stage the running chunk is (int32, 0 .. S-1), its staged leaves that stage's slice


class Stages(NamedTuple):
  """A model cut into pipeline stages (w: a device's `Weights`, staged ones the running stage's slice, w.stage its
  index; batch_i: one micro-batch's pytree; losses float32 scalars).

  first(w, batch_i) -> (x, loss, stats): on the first stage. stage(w, x, batch_i) -> (y, loss, stats): on every stage.
  last(w, y, batch_i) -> (loss, stats): on the last stage. x and y: an array, or a pytree of them whose floating-point
  leaves carry the gradient (integer ones, e.g. a choice of keys, go forward only). w.before: the (first's, stage's,
  last's) stats of the micro-batches before batch_i on this chunk, summed (None while the step traces their shapes)."""

  first: Callable
  stage: Callable
  last: Callable


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _fp32(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _record(acc, s, c, mb, ok):
  """acc with s at [c, mb] where ok."""
  return acc.at[c, mb].set(jnp.where(ok, s, acc[c, mb]))


def _differentiable(tree) -> list:
  """The floating-point leaves of an activation tree, in order: what carries a gradient back (an int32 leaf, e.g.
  `sparse_attention.Stream`'s choice of keys, travels forward only)."""
  return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]


def _with_differentiable(tree, leaves):
  """tree with its floating-point leaves replaced by `leaves`, in order."""
  it = iter(leaves)
  return jax.tree.map(lambda a: next(it) if jnp.issubdtype(a.dtype, jnp.inexact) else a, tree)


class _Device:
  """One device's part of the step inside the shard_map: its chunks' slots tick by tick (`tick`), the plan's ticks
  in one scan (`run`). w: its `Weights` (staged leaves its chunks' rows, chunk by chunk); batch_U: every micro-batch.
  A carry: (inputs [C, K_x, ...], gradients [C, K_g, ...] received, (staged gradients [C, ...], shared ones),
  loss, statistics [C, U, ...]). An activation may be a pytree: every leaf goes forward, its floating-point ones'
  gradients (`_differentiable`) come back."""

  def __init__(self, model: Stages, the: ticks_lib.Plan, axis: str, constrain, w: Weights, batch_U):
    self.model, self.the, self.axis, self.constrain, self.w, self.batch_U = model, the, axis, constrain, w, batch_U
    self.micro_batches = jax.tree.leaves(batch_U)[0].shape[0]
    self.stages, self.chunks = the.stages, the.stage_of.shape[1]
    self.stage_of = jnp.asarray(the.stage_of)[jax.lax.axis_index(axis)]
    shaped = w._replace(
      staged=self.chunk(w.staged, 0), staged_rest=self.chunk(w.staged_rest, 0), stage=self.stage_of[0]
    )
    self.x_like, _, first_stats = jax.eval_shape(model.first, shaped, self.take(0))
    _, _, stage_stats = jax.eval_shape(model.stage, shaped, self.x_like, self.take(0))
    _, last_stats = jax.eval_shape(model.last, shaped, self.x_like, self.take(0))
    self.zero_x = _zeros(self.x_like)
    self.zero_dx = _differentiable(self.zero_x)
    self.no_loss = jnp.zeros((), jnp.float32)
    self.stats_like = (first_stats, stage_stats, last_stats)

  def chunk(self, tree, c):
    return jax.tree.map(lambda a: a.reshape((self.chunks, -1) + a.shape[1:])[c], tree)

  def take(self, i):
    return jax.tree.map(lambda leaf: leaf[i], self.batch_U)

  @staticmethod
  def at(buffer_CxK, c, row):
    return jax.tree.map(lambda a: a[c, row], buffer_CxK)

  def run_stage(self, w_, staged, shared, x_in, batch_i):
    """One stage (w_.stage) on one micro-batch with these parameters: (y, loss), statistics."""
    first_stats, _, last_stats = self.stats_like
    w_ = w_._replace(staged=staged, shared=shared)
    x, loss0, stats0 = jax.lax.cond(
      w_.stage == 0, lambda: self.model.first(w_, batch_i), lambda: (x_in, self.no_loss, _zeros(first_stats))
    )
    y, loss1, stats1 = self.model.stage(w_, x, batch_i)
    loss2, stats2 = jax.lax.cond(
      w_.stage == self.stages - 1,
      lambda: self.model.last(w_, y, batch_i),
      lambda: (self.no_loss, _zeros(last_stats)),
    )
    return (y, loss0 + loss1 + loss2), (stats0, stats1, stats2)

  def view(self, stats_CxU, c, mb):
    """w for chunk c running micro-batch mb: its state's slice, its stage, its earlier micro-batches' stats."""
    earlier = lambda a: jnp.sum(
      jnp.where((jnp.arange(self.micro_batches) < mb).reshape((-1,) + (1,) * (a.ndim - 2)), a[c], jnp.zeros_like(a[c])),
      axis=0,
    )
    return self.w._replace(
      staged_rest=self.chunk(self.w.staged_rest, c), before=jax.tree.map(earlier, stats_CxU), stage=self.stage_of[c]
    )

  def forward(self, carry, c, mb):
    """F(mb) on chunk c: (y, stats); the last stage's output feeds only its own loss, which its B computes."""
    inputs_CxKxX, _, _, _, stats_CxU = carry
    w_ = self.view(stats_CxU, c, mb)
    (y, _), stats = jax.lax.cond(
      w_.stage == self.stages - 1,
      lambda: ((self.zero_x, self.no_loss), _zeros(self.stats_like)),
      lambda: self.run_stage(
        w_, self.chunk(self.w.staged, c), self.w.shared, self.at(inputs_CxKxX, c, mb % self.the.rows[0]), self.take(mb)
      ),
    )
    return y, stats

  def backward(self, carry, c, mb):
    """B(mb) on chunk c, the stage recomputed: (dx, float32 (dstaged, dshared), loss, stats)."""
    inputs_CxKxX, grads_CxKxX, _, _, stats_CxU = carry
    w_, batch_i = self.view(stats_CxU, c, mb), self.take(mb)
    x_in = self.at(inputs_CxKxX, c, mb % self.the.rows[0])

    def run(staged, shared, x_leaves):  # the stage's differentiable part: its float leaves in and out
      (y, loss), stats = self.run_stage(w_, staged, shared, _with_differentiable(x_in, x_leaves), batch_i)
      return (_differentiable(y), loss), stats

    (_, value), vjp, stats = jax.vjp(
      run, self.chunk(self.w.staged, c), self.w.shared, _differentiable(x_in), has_aux=True
    )
    last = w_.stage == self.stages - 1
    dy = [jnp.where(last, zero, g) for zero, g in zip(self.zero_dx, self.at(grads_CxKxX, c, mb % self.the.rows[1]))]
    dstaged, dshared, dx = vjp((dy, jnp.ones((), jnp.float32)))
    return dx, jax.tree.map(lambda g: g.astype(jnp.float32), (dstaged, dshared)), value, stats

  def tick(self, carry, slot):
    """One tick's slot (slot [1, 2 + links, 2]: its forward's and backward's (micro-batch, chunk), then what each
    link brings), then its transfers."""
    inputs_CxKxX, grads_CxKxX, (dstaged_C, dshared), loss, stats_CxU = carry
    (f_mb, f_c), (b_mb, b_c) = slot[0, 0], slot[0, 1]
    ran_f, ran_b = f_mb >= 0, b_mb >= 0
    f_mb, f_c, b_mb, b_c = (jnp.maximum(i, 0) for i in (f_mb, f_c, b_mb, b_c))
    y, f_stats = jax.lax.cond(
      ran_f, lambda: self.forward(carry, f_c, f_mb), lambda: (self.zero_x, _zeros(self.stats_like))
    )
    no_chunk_grads = (_fp32(self.chunk(self.w.staged, 0)), _fp32(self.w.shared))
    dx, (dstaged, dshared_b), value, b_stats = jax.lax.cond(
      ran_b,
      lambda: self.backward(carry, b_c, b_mb),
      lambda: (self.zero_dx, no_chunk_grads, self.no_loss, _zeros(self.stats_like)),
    )
    dstaged_C = jax.tree.map(lambda acc, g: acc.at[b_c].add(g), dstaged_C, dstaged)
    f_ok = ran_f & (self.stage_of[f_c] != self.stages - 1)
    stats_CxU = jax.tree.map(functools.partial(_record, c=f_c, mb=f_mb, ok=f_ok), stats_CxU, f_stats)
    stats_CxU = jax.tree.map(functools.partial(_record, c=b_c, mb=b_mb, ok=ran_b), stats_CxU, b_stats)
    inputs_CxKxX, grads_CxKxX = self.transfer(inputs_CxKxX, grads_CxKxX, slot, y, dx)
    grads = (dstaged_C, jax.tree.map(jnp.add, dshared, dshared_b))
    return (self.constrain(inputs_CxKxX), self.constrain(grads_CxKxX), grads, loss + value, stats_CxU), None

  def transfer(self, inputs_CxKxX, grads_CxKxX, slot, y, dx):
    """One ppermute per link of what the slot sent (y or dx), filed where the timetable says it arrives."""
    rows_x, rows_g = self.the.rows
    # The transfers stay outside the branches: XLA could otherwise move a ppermute into them, and stages taking
    # different branches would then wait at different collectives.
    y, dx = jax.lax.optimization_barrier((y, dx))
    for link, (kind, shift, pairs) in enumerate(self.the.links):
      sent = y if kind == F else dx
      got = jax.lax.ppermute(sent, self.axis, pairs) if shift else sent
      mb, c = slot[0, 2 + link]
      filed = lambda acc, rows: jax.tree.map(
        functools.partial(_record, c=jnp.maximum(c, 0), mb=jnp.maximum(mb, 0) % rows, ok=mb >= 0), acc, got
      )
      if kind == F:
        inputs_CxKxX = filed(inputs_CxKxX, rows_x)
      else:
        grads_CxKxX = filed(grads_CxKxX, rows_g)
    return inputs_CxKxX, grads_CxKxX

  def run(self, ticks_Tx1xLx2):
    """Every tick in one scan -> (loss, (dstaged [chunks' rows, ...], dshared), (first's, stage's [1, C, U, ...],
    last's statistics)), the loss, shared gradients and end stages' statistics summed over the axis."""
    buffer = lambda like, rows: self.constrain(
      jax.tree.map(lambda a: jnp.zeros((self.chunks, rows) + a.shape, a.dtype), like)
    )
    stats_CxU = jax.tree.map(lambda s: jnp.zeros((self.chunks, self.micro_batches) + s.shape, s.dtype), self.stats_like)
    staged_C = jax.tree.map(lambda a: a.reshape((self.chunks, -1) + a.shape[1:]), self.w.staged)
    carry = (buffer(self.x_like, self.the.rows[0]), buffer(self.zero_dx, self.the.rows[1]))
    carry += ((_fp32(staged_C), _fp32(self.w.shared)),)
    carry += (self.no_loss, stats_CxU)
    (_, _, (dstaged_C, dshared), loss, stats_CxU), _ = jax.lax.scan(self.tick, carry, ticks_Tx1xLx2)
    first_CxU, stage_CxU, last_CxU = stats_CxU
    psum = lambda a: jax.lax.psum(a, self.axis)
    total = lambda tree: jax.tree.map(lambda a: psum(jnp.sum(a, axis=0)), tree)  # on one chunk
    dstaged = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), dstaged_C)
    stage_stats = jax.tree.map(lambda a: a[None], stage_CxU)
    return psum(loss), (dstaged, jax.tree.map(psum, dshared)), (total(first_CxU), stage_stats, total(last_CxU))


def pipelined_loss_and_grads(
  model: Stages,
  weights: Weights,
  batch_U,
  mesh,
  schedule: str,
  axis: str = "stage",
  constrain=lambda x: x,
  virtual_stages: int = 1,
):
  """(loss summed over the micro-batches, (gradients of weights.staged, of weights.shared), statistics) of the model
  pipelined over `mesh`'s `axis` by `schedule`.

  weights: staged leaves [n, ...], n a multiple of the schedule's S stages (`Schedule.layer_stages`); batch_U: leaves
  [U, ...], micro-batch i at [i]. The gradients are float32 sums over the micro-batches. statistics: (first's
  [U, ...], stage's [S, U, ...] (stage k's at [k]), last's [U, ...]). constrain: applied to the activation buffers
  [C, K, ...] (their sharding over the other axes)."""
  devices = mesh.shape[axis]
  the = ticks_lib.plan(schedule, devices, jax.tree.leaves(batch_U)[0].shape[0], virtual_stages)
  stages = the.stages
  require(
    all(leaf.shape[0] % stages == 0 for leaf in jax.tree.leaves((weights.staged, weights.staged_rest))),
    "staged",
    "leaves [n, ...]",
    f"n a multiple of the {stages} stages of {schedule} over the {devices} devices of mesh axis {axis!r}",
  )
  moved = not np.array_equal(the.stage_of.reshape(-1), np.arange(stages))
  placed = lambda tree: jax.tree.map(lambda a: jnp.take(a, the.layout(a.shape[0]), axis=0) if moved else a, tree)
  specs = Weights(P(axis), P(), P(axis), P())
  run = jax.shard_map(
    lambda w, batch_U, ticks: _Device(model, the, axis, constrain, w, batch_U).run(ticks),
    mesh=mesh,
    in_specs=(specs, P(), P(None, axis)),
    out_specs=(P(), (P(axis), P()), (P(), P(axis), P())),
    axis_names={axis},
    check_vma=False,
  )
  loss, (dstaged, dshared), (first_U, stage_PxCxU, last_U) = run(
    weights._replace(staged=placed(weights.staged), staged_rest=placed(weights.staged_rest)),
    batch_U,
    jnp.asarray(the.ticks),
  )
  # Back to the leaves' layout: each stage's gradient (dualpipe: the sum of its two copies'), each stage's stats.
  back = lambda a, g: jnp.zeros(a.shape, jnp.float32).at[the.layout(a.shape[0])].add(g) if moved else g
  by_stage = lambda a: (
    jnp.zeros((stages,) + a.shape[2:], a.dtype).at[the.stage_of.reshape(-1)].add(a.reshape((-1,) + a.shape[2:]))
  )
  return (
    loss,
    (jax.tree.map(back, weights.staged, dstaged), dshared),
    (first_U, jax.tree.map(by_stage, stage_PxCxU), last_U),
  )
