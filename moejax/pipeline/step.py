"""A pipelined loss and gradient, run from a schedule's timetable: stages over a mesh axis, activations and their
gradients moved by `jax.lax.ppermute` inside `jax.shard_map`, the ticks of the timetable in one `jax.lax.scan`.

A model is three functions (`Stages`): `first` on the first stage (the embeddings: micro-batch -> activation),
`stage` on every stage (its slice of the layers: activation -> activation) and `last` on the last (the head and the
loss). Each also returns a loss term (summed into the loss: the MoE layers' auxiliary losses, the task loss) and
statistics (summed per micro-batch, not differentiated: expert counts, ...). A device holds (`Weights`) its stage's
slice of the staged parameters (leaves [n, ...] sharded over the axis: stage s holds rows s n/p .. (s+1) n/p - 1) and
the shared ones (the embeddings, the head: replicated over the axis, their gradients summed over it), each with its
non-differentiated state beside it (slot tables, balancing biases, key streams).

At tick t each device runs the slot its timetable starts then (unit F = B times, so every slot is one tick): F(i) runs
its stage on micro-batch i's input (the first stage `first` of the micro-batch, the others what their predecessor
sent) and keeps that input; B(i) recomputes the stage's vjp at the kept input (the stage rematerialised) with the
output's gradient (the last stage's output feeds its own loss: none), adds the parameters' gradients and sends the
input's back; its loss is recorded there, once, its statistics at the micro-batch's F (the last stage's at its B,
again by B elsewhere: the same values). A stage also reads `Weights.before`, its statistics of the micro-batches
before the running one summed: gpipe and 1f1b run each stage's forwards (the last stage's backwards) in micro-batch
order, so they are recorded by then (a balance loss over the step's earlier micro-batches). After each tick one ppermute carries every F's output
to the next stage and one every B's input-gradient to the previous; the receiver files it under the micro-batch the
timetable says its neighbour ran. Schedules of one chunk a device and no paired slots run: gpipe, 1f1b.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.pipeline import memory, schedules
from moejax.pipeline.timetable import B, F
from moejax.validation import require

IDLE, FORWARD, BACKWARD = 0, 1, 2
RUNS = ("gpipe", "1f1b")  # the schedules the step runs
# What the step lacks for the other timetables (`schedules`), named in their refusal.
MISSING = {
    "interleaved": "v chunks of the staged layers a device, stage d's chunks d, d+p, ... (not one block of the "
                   "stacked [r, ...] leaves: a stored layout [v, p, r/(vp), ...] or a reshuffle of the parameters "
                   "every step), a chunk per slot, and a ring transfer from the last device to the first",
    "dualpipe": "a slot running one micro-batch's forward and another's backward together (F&B), and two chunks a "
                "device, stages d and p-1-d (a second copy of the parameters, its gradients summed with the "
                "first's), each sending both ways",
    "dualpipev": "two chunks a device, stages d and p-1-d (not one block of the stacked [r, ...] leaves), the "
                 "F&B slot, and the turn from chunk 0 to chunk 1 on the last device",
}


def why_not(schedule: str) -> str:
  """What the step expects of a schedule it does not run, and what that schedule lacks."""
  if schedule not in MISSING:
    return "gpipe or 1f1b"
  return f"gpipe or 1f1b: {schedule} is a timetable the cost model prices; the step lacks {MISSING[schedule]}"


class Weights(NamedTuple):
  """What the stages read: staged (leaves [n, ...], split over the stages) and shared (replicated) parameters, the
  gradients' arguments, and their non-differentiated state alike (staged_rest [n, ...], shared_rest)."""

  staged: object
  shared: object
  staged_rest: object = None
  shared_rest: object = None
  before: object = None  # (first's, stage's, last's statistics) of this device's earlier micro-batches, summed


class Stages(NamedTuple):
  """A model cut into pipeline stages (w: a device's `Weights`, staged ones its stage's slice; batch_i: one
  micro-batch's pytree; losses float32 scalars).

  first(w, batch_i) -> (x, loss, stats): on the first stage. stage(w, x, batch_i) -> (y, loss, stats): on every
  stage. last(w, y, batch_i) -> (loss, stats): on the last stage. w.before: the (first's, stage's, last's) stats of
  the micro-batches before batch_i on this device, summed (None while the step traces their shapes)."""

  first: Callable
  stage: Callable
  last: Callable


def tick_table(schedule: str, stages: int, micro_batches: int) -> np.ndarray:
  """[4, ticks, stages] int32: per tick and device the slot's kind (IDLE, FORWARD, BACKWARD), its micro-batch, the
  micro-batch whose activation arrives from the previous stage after the tick and the one whose gradient arrives
  from the next (-1: none)."""
  require(schedule in RUNS, "schedule", schedule, why_not(schedule))
  table = schedules.timetable(schedule, stages, micro_batches)
  ticks = int(round(table.makespan))
  out = np.full((4, ticks, stages), -1, np.int32)
  out[0] = IDLE
  for d, slots in enumerate(table.slots):
    for slot in slots:
      (op,) = slot.ops
      t = int(round(slot.start))
      out[0, t, d], out[1, t, d] = (FORWARD if op.kind == F else BACKWARD), op.micro_batch
      if op.kind == F and d + 1 < stages:
        out[2, t, d + 1] = op.micro_batch
      if op.kind == B and d > 0:
        out[3, t, d - 1] = op.micro_batch
  return out


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def pipelined_loss_and_grads(model: Stages, weights: Weights, batch_U, mesh, schedule: str, axis: str = "stage",
                             constrain=lambda x: x):
  """(loss summed over the micro-batches, (gradients of weights.staged, of weights.shared), statistics) of the model
  pipelined over `mesh`'s `axis` by `schedule`.

  weights: staged leaves [n, ...], n a multiple of the axis' p stages; batch_U: leaves [U, ...], micro-batch i at
  [i]. The gradients are float32 sums over the micro-batches. statistics: (first's [U, ...], stage's [p, U, ...]
  (stage s's at [s]), last's [U, ...]). constrain: applied to the activation buffers [K, ...] (their sharding over
  the other axes)."""
  stages = mesh.shape[axis]
  micro_batches = jax.tree.leaves(batch_U)[0].shape[0]
  staged = (weights.staged, weights.staged_rest)
  require(all(leaf.shape[0] % stages == 0 for leaf in jax.tree.leaves(staged)), "staged", "leaves [n, ...]",
          f"n a multiple of the {stages} stages of mesh axis {axis!r}")
  ticks = jnp.asarray(tick_table(schedule, stages, micro_batches))
  # Buffers of the most micro-batches a device holds at once (1F1B: p, GPipe: m), micro-batch i in row i mod that:
  # what a device holds is a run of consecutive micro-batches, so no two live ones share a row.
  rows = int(max(memory.activations_in_flight(schedules.timetable(schedule, stages, micro_batches))))
  forward_to = [(s, s + 1) for s in range(stages - 1)]
  backward_to = [(s + 1, s) for s in range(stages - 1)]
  fp32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)

  def local(w, batch_U, ticks_4xTx1):
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    take = lambda i: jax.tree.map(lambda leaf: leaf[i], batch_U)
    x_like, _, first_stats = jax.eval_shape(model.first, w, take(0))
    _, _, stage_stats = jax.eval_shape(model.stage, w, x_like, take(0))
    _, last_stats = jax.eval_shape(model.last, w, x_like, take(0))
    zero_x = _zeros(x_like)
    no_loss = jnp.zeros((), jnp.float32)

    def run(before, staged, shared, x_in, batch_i):
      """This stage on one micro-batch with these parameters: (y, loss), statistics."""
      w_ = w._replace(staged=staged, shared=shared, before=before)
      x, loss0, stats0 = jax.lax.cond(first, lambda: model.first(w_, batch_i),
                                      lambda: (x_in, no_loss, _zeros(first_stats)))
      y, loss1, stats1 = model.stage(w_, x, batch_i)
      loss2, stats2 = jax.lax.cond(last, lambda: model.last(w_, y, batch_i), lambda: (no_loss, _zeros(last_stats)))
      return (y, loss0 + loss1 + loss2), (stats0, stats1, stats2)

    stats_like = (first_stats, stage_stats, last_stats)
    no_grads = (fp32(w.staged), fp32(w.shared))

    def tick(carry, slot):
      inputs_KxX, grads_KxX, grads, loss, stats_U = carry
      kind, mb, arrives_f, arrives_b = slot[0, 0], slot[1, 0], slot[2, 0], slot[3, 0]
      mb = jnp.maximum(mb, 0)
      row = mb % rows
      batch_i, x_in = take(mb), inputs_KxX[row]
      earlier = lambda a: jnp.sum(jnp.where((jnp.arange(micro_batches) < mb).reshape((-1,) + (1,) * (a.ndim - 1)),
                                            a, jnp.zeros_like(a)), axis=0)
      chain = functools.partial(run, jax.tree.map(earlier, stats_U))

      def idle():
        return zero_x, zero_x, no_grads, no_loss, _zeros(stats_like)

      def forward():  # the last stage's output feeds only its own loss, which its B computes
        (y, _), stats = jax.lax.cond(last, lambda: ((zero_x, no_loss), _zeros(stats_like)),
                                     lambda: chain(w.staged, w.shared, x_in, batch_i))
        return y, zero_x, no_grads, no_loss, stats

      def backward():
        (_, value), vjp, stats = jax.vjp(lambda a, b, x: chain(a, b, x, batch_i), w.staged, w.shared, x_in,
                                         has_aux=True)
        dy = jnp.where(last, jnp.zeros_like(x_in), grads_KxX[row])
        dstaged, dshared, dx = vjp((dy, jnp.ones((), jnp.float32)))
        return zero_x, dx, jax.tree.map(lambda g: g.astype(jnp.float32), (dstaged, dshared)), value, stats

      out, back, dgrads, value, stats = jax.lax.switch(kind, [idle, forward, backward])
      # The transfers stay outside the branches: XLA could otherwise move a ppermute into them, and stages taking
      # different branches would then wait at different collectives.
      out, back = jax.lax.optimization_barrier((out, back))
      sent_f = jax.lax.ppermute(out, axis, forward_to)
      sent_b = jax.lax.ppermute(back, axis, backward_to)
      inputs_KxX = jnp.where(arrives_f >= 0, inputs_KxX.at[arrives_f % rows].set(sent_f), inputs_KxX)
      grads_KxX = jnp.where(arrives_b >= 0, grads_KxX.at[arrives_b % rows].set(sent_b), grads_KxX)
      record = (kind == BACKWARD) | ((kind == FORWARD) & ~last)
      stats_U = jax.tree.map(lambda acc, s: jnp.where(record, acc.at[mb].set(s), acc), stats_U, stats)
      return (constrain(inputs_KxX), constrain(grads_KxX), jax.tree.map(jnp.add, grads, dgrads), loss + value,
              stats_U), None

    buffer = constrain(jnp.zeros((rows,) + x_like.shape, x_like.dtype))
    stats_U = jax.tree.map(lambda s: jnp.zeros((micro_batches,) + s.shape, s.dtype), stats_like)
    carry = (buffer, buffer, no_grads, no_loss, stats_U)
    (_, _, (dstaged, dshared), loss, stats_U), _ = jax.lax.scan(tick, carry, jnp.moveaxis(ticks_4xTx1, 1, 0))
    first_U, stage_U, last_U = stats_U
    total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, axis), tree)  # nonzero on one stage, or summed
    return total(loss), (dstaged, total(dshared)), (total(first_U), jax.tree.map(lambda a: a[None], stage_U),
                                                    total(last_U))

  specs = Weights(P(axis), P(), P(axis), P())
  run = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P(None, None, axis)),
                      out_specs=(P(), (P(axis), P()), (P(), P(axis), P())), axis_names={axis}, check_vma=False)
  return run(weights, batch_U, ticks)
