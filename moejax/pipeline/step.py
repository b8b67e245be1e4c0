"""A pipelined loss and gradient, run from a schedule's timetable: stages over a mesh axis, activations and their
gradients moved by `jax.lax.ppermute` inside `jax.shard_map`, the ticks of the timetable in one `jax.lax.scan`.

A model is three functions (`Stages`): `first` on the first stage (the embeddings: micro-batch -> activation),
`stage` on every stage (its slice of the layers: activation -> activation) and `last` on the last (the head and the
loss). Each also returns a loss term (summed into the loss: the MoE layers' auxiliary losses, the task loss) and
statistics (summed per micro-batch, not differentiated: expert counts, ...). The staged parameters (leaves [n, ...],
stage k's slice rows k n/S .. (k+1) n/S - 1 of the schedule's S stages) are cut into chunks: a device holds one chunk
per stage it runs (gpipe, 1f1b: stage d on device d; interleaved: stages d, d+p, ...; dualpipev: stages d and
2p-1-d, the V; dualpipe: stages d and p-1-d, a second copy of every stage). The step lays them out so (`Plan.layout`:
a permutation of the stacked slices, repeating a slice for dualpipe, sharded over the axis), and sums the gradients
back into the leaves' own layout. The shared parameters (the embeddings, the head) are replicated over the axis, their
gradients summed over it; each parameter's non-differentiated state (slot tables, balancing biases) goes with it.

At tick t each device runs the slot its timetable starts then (`TICKS`: every slot one tick, a paired F&B slot
too): F(i) runs its chunk on micro-batch i's input (the first stage `first` of the micro-batch, the others what
their predecessor sent) and keeps that input; B(i) recomputes the chunk's vjp at the kept input (the stage
rematerialised) with the output's gradient (the last stage's output feeds its own loss: none), adds the parameters'
gradients and sends the input's back; a paired slot runs both (one micro-batch's forward, another's backward, on
its two chunks). A split-off W is no slot here: B computes the whole backward. The loss is recorded at the last
stage's B, once, a chunk's statistics at the micro-batch's F (the last stage's at its B, again by B elsewhere: the
same values). A chunk also reads `Weights.before`, its statistics of the micro-batches before the running one
summed: every schedule runs a chunk's forwards (the last stage's backwards) in micro-batch order, so they are
recorded by then (a balance loss over the step's earlier micro-batches; dualpipe's second copy runs the second half
of the micro-batches, so a chunk holds only its own half's). After each tick one ppermute per link (`Plan.links`: the
F outputs, or the B input-gradients, that go the same way, e.g. down the V and back up it) carries what the slot
sends to the device holding the next (previous) stage; a link to the device itself (the V's turn from chunk 0 to
chunk 1 on the last device) is no transfer. The receiver files it under the (micro-batch, chunk) the timetable says.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.pipeline import schedules
from moejax.pipeline.timetable import B, Durations, F, W
from moejax.validation import require

RUNS = ("gpipe", "1f1b", "interleaved", "dualpipe", "dualpipev")  # the schedules the step runs
# The step's clock: every slot one tick, a paired F&B slot one tick too (both run in it), a W none.
TICKS = Durations(f=1.0, b=1.0, w=0.0, fb=1.0)


def layer_stages(schedule: str, devices: int, virtual_stages: int = 1) -> int:
  """S, the stages the staged layers are cut into (a route's length): 2p for dualpipev on p devices (the V),
  p v for interleaved, p otherwise."""
  return {"dualpipev": 2 * devices, "interleaved": devices * virtual_stages}.get(schedule, devices)


def timetable(schedule: str, devices: int, micro_batches: int, virtual_stages: int = 1):
  """The schedule's timetable over `devices` devices (dualpipev's p stages are 2 x its devices), timed in the step's
  ticks."""
  require(schedule in RUNS, "schedule", schedule, f"one of {RUNS}")
  return schedules.timetable(
    schedule, 2 * devices if schedule == "dualpipev" else devices, micro_batches, virtual_stages, TICKS
  )


class Plan(NamedTuple):
  """A timetable as the step runs it. stage_of [p, C]: the stage (place in every route) each device's chunk runs;
  ticks [T, p, 2 + links, 2] int32: per tick and device the slot's forward and backward and, per link, what arrives
  after the tick, each a (micro-batch, chunk), (-1, -1) none; links: per link (kind, shift, pairs): F outputs (or B
  input-gradients) sent `shift` devices on, pairs its (source, destination) devices, none for shift 0 (kept on the
  device); rows (inputs, gradients): a buffer's rows a chunk, micro-batch i in row i mod rows."""

  stages: int
  stage_of: np.ndarray
  ticks: np.ndarray
  links: tuple
  rows: tuple[int, int]

  def layout(self, n: int) -> np.ndarray:
    """The rows of staged leaves [n, ...] the devices hold, device by device, chunk by chunk (each chunk its stage's
    n/S rows)."""
    per = n // self.stages
    return np.concatenate([np.arange(k * per, (k + 1) * per) for k in self.stage_of.reshape(-1)])


def _fewest_rows(held: dict, micro_batches: int) -> int:
  """The fewest rows r such that no two micro-batches in one row (i mod r) are held at once. held: per buffer, the
  (micro-batch, tick it is filed after, last tick it is read) of each entry."""
  clash = lambda r: any(
    i != j and i % r == j % r and a < y and x < b
    for entries in held.values()
    for i, a, b in entries
    for j, x, y in entries
  )
  return next(r for r in range(1, micro_batches + 1) if not clash(r))


def plan(schedule: str, devices: int, micro_batches: int, virtual_stages: int = 1) -> Plan:
  """The step's `Plan` of `schedule` over `devices` devices."""
  table = timetable(schedule, devices, micro_batches, virtual_stages)
  stages = len(table.routes[0])
  stage_of = np.full((devices, 1 + max(c for route in table.routes for _, c in route)), -1, np.int32)
  for route in table.routes:
    for k, (d, c) in enumerate(route):
      if stage_of[d, c] not in (-1, k):
        raise ValueError(f"{schedule}: device {d}'s chunk {c} runs stages {stage_of[d, c]} and {k}")
      stage_of[d, c] = k
  ticks = int(round(table.makespan))
  ops = np.full((ticks, devices, 2, 2), -1, np.int32)
  sends, reads = [], {}
  for d, slots in enumerate(table.slots):
    for slot in slots:
      t = int(round(slot.start))
      for op in slot.ops:
        if op.kind == W:
          continue
        j = (F, B).index(op.kind)
        if t != slot.start or ops[t, d, j, 0] >= 0:
          raise ValueError(f"{schedule}: device {d}'s {op} is not alone in its tick {slot.start}")
        ops[t, d, j] = (op.micro_batch, op.chunk)
        route = table.routes[op.micro_batch]
        k = route.index((d, op.chunk)) + (1 if op.kind == F else -1)
        if 0 <= k < stages:
          sends.append((op.kind, t, d, route[k], op.micro_batch))
        if op.kind == B:
          reads[(B, d, op.chunk, op.micro_batch)] = reads[(F, d, op.chunk, op.micro_batch)] = t
  keys = sorted({(kind, to - d) for kind, _, d, (to, _), _ in sends})
  links = tuple(
    (
      kind,
      shift,
      () if shift == 0 else tuple(sorted({(d, to) for k, _, d, (to, _), _ in sends if (k, to - d) == (kind, shift)})),
    )
    for kind, shift in keys
  )
  arrivals = np.full((ticks, devices, len(links), 2), -1, np.int32)
  held = {}
  for kind, t, d, (to, c), mb in sends:
    arrivals[t, to, keys.index((kind, to - d))] = (mb, c)
    held.setdefault((kind, to, c), []).append((mb, t, reads[(kind, to, c, mb)]))
  rows = tuple(_fewest_rows({k: v for k, v in held.items() if k[0] == kind}, micro_batches) for kind in (F, B))
  return Plan(stages, stage_of, np.concatenate([ops, arrivals], axis=2), links, rows)


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

  first(w, batch_i) -> (x, loss, stats): on the first stage. stage(w, x, batch_i) -> (y, loss, stats): on every
  stage. last(w, y, batch_i) -> (loss, stats): on the last stage. w.before: the (first's, stage's, last's) stats of
  the micro-batches before batch_i on this chunk, summed (None while the step traces their shapes)."""

  first: Callable
  stage: Callable
  last: Callable


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


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

  weights: staged leaves [n, ...], n a multiple of the schedule's S stages (`layer_stages`); batch_U: leaves
  [U, ...], micro-batch i at [i]. The gradients are float32 sums over the micro-batches. statistics: (first's
  [U, ...], stage's [S, U, ...] (stage k's at [k]), last's [U, ...]). constrain: applied to the activation buffers
  [C, K, ...] (their sharding over the other axes)."""
  devices = mesh.shape[axis]
  micro_batches = jax.tree.leaves(batch_U)[0].shape[0]
  the = plan(schedule, devices, micro_batches, virtual_stages)
  stages, chunks = the.stages, the.stage_of.shape[1]
  staged = (weights.staged, weights.staged_rest)
  require(
    all(leaf.shape[0] % stages == 0 for leaf in jax.tree.leaves(staged)),
    "staged",
    "leaves [n, ...]",
    f"n a multiple of the {stages} stages of {schedule} over the {devices} devices of mesh axis {axis!r}",
  )
  moved = not np.array_equal(the.stage_of.reshape(-1), np.arange(stages))
  placed = lambda tree: jax.tree.map(lambda a: jnp.take(a, the.layout(a.shape[0]), axis=0) if moved else a, tree)
  fp32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
  rows_x, rows_g = the.rows

  def local(w, batch_U, ticks_Tx1xLx2):
    device = jax.lax.axis_index(axis)
    stage_of = jnp.asarray(the.stage_of)[device]
    chunk = lambda tree, c: jax.tree.map(lambda a: a.reshape((chunks, -1) + a.shape[1:])[c], tree)
    take = lambda i: jax.tree.map(lambda leaf: leaf[i], batch_U)
    shaped = w._replace(staged=chunk(w.staged, 0), staged_rest=chunk(w.staged_rest, 0), stage=stage_of[0])
    x_like, _, first_stats = jax.eval_shape(model.first, shaped, take(0))
    _, _, stage_stats = jax.eval_shape(model.stage, shaped, x_like, take(0))
    _, last_stats = jax.eval_shape(model.last, shaped, x_like, take(0))
    zero_x = _zeros(x_like)
    no_loss = jnp.zeros((), jnp.float32)
    stats_like = (first_stats, stage_stats, last_stats)

    def run(w_, staged, shared, x_in, batch_i):
      """One stage (w_.stage) on one micro-batch with these parameters: (y, loss), statistics."""
      w_ = w_._replace(staged=staged, shared=shared)
      x, loss0, stats0 = jax.lax.cond(
        w_.stage == 0, lambda: model.first(w_, batch_i), lambda: (x_in, no_loss, _zeros(first_stats))
      )
      y, loss1, stats1 = model.stage(w_, x, batch_i)
      loss2, stats2 = jax.lax.cond(
        w_.stage == stages - 1, lambda: model.last(w_, y, batch_i), lambda: (no_loss, _zeros(last_stats))
      )
      return (y, loss0 + loss1 + loss2), (stats0, stats1, stats2)

    def tick(carry, slot):
      inputs_CxKxX, grads_CxKxX, (dstaged_C, dshared), loss, stats_CxU = carry
      (f_mb, f_c), (b_mb, b_c) = slot[0, 0], slot[0, 1]
      f_mb, f_c, b_mb, b_c, ran_f, ran_b = (
        jnp.maximum(f_mb, 0),
        jnp.maximum(f_c, 0),
        jnp.maximum(b_mb, 0),
        jnp.maximum(b_c, 0),
        f_mb >= 0,
        b_mb >= 0,
      )

      def view(c, mb):
        """w for chunk c running micro-batch mb: its state's slice, its stage, its earlier micro-batches' stats."""
        earlier = lambda a: jnp.sum(
          jnp.where((jnp.arange(micro_batches) < mb).reshape((-1,) + (1,) * (a.ndim - 2)), a[c], jnp.zeros_like(a[c])),
          axis=0,
        )
        return w._replace(
          staged_rest=chunk(w.staged_rest, c), before=jax.tree.map(earlier, stats_CxU), stage=stage_of[c]
        )

      def forward():  # the last stage's output feeds only its own loss, which its B computes
        w_ = view(f_c, f_mb)
        (y, _), stats = jax.lax.cond(
          w_.stage == stages - 1,
          lambda: ((zero_x, no_loss), _zeros(stats_like)),
          lambda: run(w_, chunk(w.staged, f_c), w.shared, inputs_CxKxX[f_c, f_mb % rows_x], take(f_mb)),
        )
        return y, stats

      def backward():
        w_, batch_i = view(b_c, b_mb), take(b_mb)
        (_, value), vjp, stats = jax.vjp(
          lambda a, b, x: run(w_, a, b, x, batch_i),
          chunk(w.staged, b_c),
          w.shared,
          inputs_CxKxX[b_c, b_mb % rows_x],
          has_aux=True,
        )
        dy = jnp.where(w_.stage == stages - 1, jnp.zeros_like(zero_x), grads_CxKxX[b_c, b_mb % rows_g])
        dstaged, dshared, dx = vjp((dy, jnp.ones((), jnp.float32)))
        return dx, jax.tree.map(lambda g: g.astype(jnp.float32), (dstaged, dshared)), value, stats

      y, f_stats = jax.lax.cond(ran_f, forward, lambda: (zero_x, _zeros(stats_like)))
      no_chunk_grads = (fp32(chunk(w.staged, 0)), fp32(w.shared))
      dx, (dstaged, dshared_b), value, b_stats = jax.lax.cond(
        ran_b, backward, lambda: (zero_x, no_chunk_grads, no_loss, _zeros(stats_like))
      )
      dstaged_C = jax.tree.map(lambda acc, g: acc.at[b_c].add(g), dstaged_C, dstaged)
      record = lambda acc, s, c, mb, ok: acc.at[c, mb].set(jnp.where(ok, s, acc[c, mb]))
      stats_CxU = jax.tree.map(
        functools.partial(record, c=f_c, mb=f_mb, ok=ran_f & (stage_of[f_c] != stages - 1)), stats_CxU, f_stats
      )
      stats_CxU = jax.tree.map(functools.partial(record, c=b_c, mb=b_mb, ok=ran_b), stats_CxU, b_stats)
      # The transfers stay outside the branches: XLA could otherwise move a ppermute into them, and stages taking
      # different branches would then wait at different collectives.
      y, dx = jax.lax.optimization_barrier((y, dx))
      for link, (kind, shift, pairs) in enumerate(the.links):
        sent = y if kind == F else dx
        got = jax.lax.ppermute(sent, axis, pairs) if shift else sent
        mb, c = slot[0, 2 + link]
        filed = functools.partial(record, c=jnp.maximum(c, 0), ok=mb >= 0)
        if kind == F:
          inputs_CxKxX = filed(inputs_CxKxX, mb=jnp.maximum(mb, 0) % rows_x, s=got)
        else:
          grads_CxKxX = filed(grads_CxKxX, mb=jnp.maximum(mb, 0) % rows_g, s=got)
      grads = (dstaged_C, jax.tree.map(jnp.add, dshared, dshared_b))
      return (constrain(inputs_CxKxX), constrain(grads_CxKxX), grads, loss + value, stats_CxU), None

    buffer = lambda rows: constrain(jnp.zeros((chunks, rows) + x_like.shape, x_like.dtype))
    stats_CxU = jax.tree.map(lambda s: jnp.zeros((chunks, micro_batches) + s.shape, s.dtype), stats_like)
    no_grads = (fp32(jax.tree.map(lambda a: a.reshape((chunks, -1) + a.shape[1:]), w.staged)), fp32(w.shared))
    carry = (buffer(rows_x), buffer(rows_g), no_grads, no_loss, stats_CxU)
    (_, _, (dstaged_C, dshared), loss, stats_CxU), _ = jax.lax.scan(tick, carry, ticks_Tx1xLx2)
    first_CxU, stage_CxU, last_CxU = stats_CxU
    total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(jnp.sum(a, axis=0), axis), tree)  # on one chunk
    dstaged = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), dstaged_C)
    return (
      jax.lax.psum(loss, axis),
      (dstaged, jax.tree.map(lambda a: jax.lax.psum(a, axis), dshared)),
      (total(first_CxU), jax.tree.map(lambda a: a[None], stage_CxU), total(last_CxU)),
    )

  specs = Weights(P(axis), P(), P(axis), P())
  run = jax.shard_map(
    local,
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
