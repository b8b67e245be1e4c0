"""A pipelined loss and gradient, run from a schedule's timetable: stages over a mesh axis, activations and their
gradients moved by `jax.lax.ppermute` inside `jax.shard_map`, the ticks of the timetable in one `jax.lax.scan`.

Each device holds one stage's parameters (a slice of the stacked layers: leaves [p, ...] sharded over the axis) and
runs, at tick t, the slot its timetable starts then (unit F = B times, so every slot is one tick): F(i) runs the
stage on micro-batch i's input (the first stage reads the batch, the others what their predecessor sent) and keeps
that input; the last stage's F also takes the loss and its gradient; B(i) recomputes the stage's vjp at the kept
input (the stage rematerialised) with the output's gradient (the last stage's own, else what its successor sent),
adds the parameters' gradient and sends the input's back. After each tick one ppermute carries every F's output to
the next stage and one every B's input-gradient to the previous; the receiver files it under the micro-batch the
timetable says its neighbour ran. Schedules of one chunk a device and no paired slots run: gpipe, 1f1b.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.pipeline import memory, schedules
from moejax.pipeline.timetable import B, F
from moejax.validation import require

IDLE, FORWARD, BACKWARD = 0, 1, 2


def tick_table(schedule: str, stages: int, micro_batches: int) -> np.ndarray:
  """[4, ticks, stages] int32: per tick and device the slot's kind (IDLE, FORWARD, BACKWARD), its micro-batch, the
  micro-batch whose activation arrives from the previous stage after the tick and the one whose gradient arrives
  from the next (-1: none)."""
  require(schedule in ("gpipe", "1f1b"), "schedule", schedule, "gpipe or 1f1b (the step runs one chunk a device, "
          "no paired slots)")
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


def pipelined_loss_and_grads(stage_fn, loss_fn, params, x_UxBxD, targets_U, mesh, schedule: str,
                             axis: str = "stage"):
  """(mean loss over micro-batches, gradients of `params`) of loss_fn(stage_{p-1}(... stage_0(x_i)), targets_i),
  pipelined over `mesh`'s `axis` by `schedule`.

  stage_fn(stage_params, x_BxD) -> y_BxD: one stage (its params: a leaf's [p, ...] slice); loss_fn(y_BxD, target)
  -> scalar; params: leaves [p, ...]; x_UxBxD: the micro-batches; targets_U: a pytree of leaves [U, ...]."""
  stages, micro_batches = mesh.shape[axis], x_UxBxD.shape[0]
  require(all(leaf.shape[0] == stages for leaf in jax.tree.leaves(params)), "params", "leaves [p, ...]",
          f"every leaf stacked over the {stages} stages of mesh axis {axis!r}")
  ticks = jnp.asarray(tick_table(schedule, stages, micro_batches))
  # Buffers of the most micro-batches a device holds at once (1F1B: p, GPipe: m), micro-batch i in row i mod that:
  # what a device holds is a run of consecutive micro-batches, so no two live ones share a row.
  rows = int(max(memory.activations_in_flight(schedules.timetable(schedule, stages, micro_batches))))
  forward_to = [(s, s + 1) for s in range(stages - 1)]
  backward_to = [(s + 1, s) for s in range(stages - 1)]

  def local(params, x_UxBxD, targets_U, ticks_4xTx1):
    params = jax.tree.map(lambda leaf: leaf[0], params)
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    zeros_KxBxD = jnp.zeros((rows,) + x_UxBxD.shape[1:], x_UxBxD.dtype)

    def tick(carry, slot):
      inputs_KxBxD, grads_KxBxD, dparams, loss = carry
      kind, mb, arrives_f, arrives_b = slot[0, 0], slot[1, 0], slot[2, 0], slot[3, 0]
      mb = jnp.maximum(mb, 0)
      row = mb % rows
      x_BxD = jnp.where(first, x_UxBxD[mb], inputs_KxBxD[row])
      target = jax.tree.map(lambda leaf: leaf[mb], targets_U)

      def idle():
        return jnp.zeros_like(x_BxD), jnp.zeros_like(x_BxD), jax.tree.map(jnp.zeros_like, dparams), 0.0

      def forward():
        y_BxD = stage_fn(params, x_BxD)
        value, dy_BxD = jax.lax.cond(last, lambda: jax.value_and_grad(loss_fn)(y_BxD, target),
                                     lambda: (jnp.zeros((), y_BxD.dtype), jnp.zeros_like(y_BxD)))
        return y_BxD, dy_BxD, jax.tree.map(jnp.zeros_like, dparams), value

      def backward():
        _, vjp = jax.vjp(stage_fn, params, x_BxD)
        dstage, dx_BxD = vjp(grads_KxBxD[row])
        return jnp.zeros_like(x_BxD), dx_BxD, dstage, 0.0

      out_BxD, back_BxD, dstage, value = jax.lax.switch(kind, [idle, forward, backward])
      # The last stage's forward files its own output gradient; a backward's input gradient goes back.
      grads_KxBxD = jnp.where(last & (kind == FORWARD), grads_KxBxD.at[row].set(back_BxD), grads_KxBxD)
      sent_f = jax.lax.ppermute(out_BxD, axis, forward_to)
      sent_b = jax.lax.ppermute(jnp.where(kind == BACKWARD, back_BxD, 0.0), axis, backward_to)
      inputs_KxBxD = jnp.where(arrives_f >= 0, inputs_KxBxD.at[arrives_f % rows].set(sent_f), inputs_KxBxD)
      grads_KxBxD = jnp.where(arrives_b >= 0, grads_KxBxD.at[arrives_b % rows].set(sent_b), grads_KxBxD)
      dparams = jax.tree.map(jnp.add, dparams, dstage)
      return (inputs_KxBxD, grads_KxBxD, dparams, loss + value), None

    carry = (zeros_KxBxD, zeros_KxBxD, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), x_UxBxD.dtype))
    (_, _, dparams, loss), _ = jax.lax.scan(tick, carry, jnp.moveaxis(ticks_4xTx1, 1, 0))
    scale = 1.0 / micro_batches
    loss = jax.lax.psum(loss, axis) * scale
    return loss, jax.tree.map(lambda g: g[None] * scale, dparams)

  stacked = jax.tree.map(lambda _: P(axis), params)
  run = jax.shard_map(local, mesh=mesh, in_specs=(stacked, P(), P(), P(None, None, axis)),
                      out_specs=(P(), stacked), axis_names={axis}, check_vma=False)
  return run(params, x_UxBxD, targets_U, ticks)
