"""Each pipeline schedule's slots: the route of every micro-batch (the (device, chunk) of each stage it passes) and
the order of every device's slots, from p (the schedule's stages, `moejax.pipeline.schedules`), m (micro-batches)
and v (interleaved's chunks a device). Each generator returns (routes, orders); `moejax.pipeline.timetable.simulate`
times them from the dependencies alone.
"""

from moejax.pipeline.timetable import B, F, Op, W


def _one_stage_routes(p: int, m: int):
  return [[(d, 0) for d in range(p)] for _ in range(m)]


def gpipe(p: int, m: int, v: int):
  orders = [[(Op(F, i, 0),) for i in range(m)] + [(Op(B, i, 0),) for i in range(m)] for _ in range(p)]
  return _one_stage_routes(p, m), orders


def one_f_one_b(p: int, m: int, v: int):
  orders = []
  for d in range(p):
    warm = min(p - d - 1, m)
    order = [(Op(F, i, 0),) for i in range(warm)]
    for i in range(m - warm):
      order += [(Op(F, warm + i, 0),), (Op(B, i, 0),)]
    orders.append(order + [(Op(B, i, 0),) for i in range(m - warm, m)])
  return _one_stage_routes(p, m), orders


def interleaved(p: int, m: int, v: int):
  """Megatron's order: the k-th forward of a device is chunk (k // p) % v of micro-batch (k // pv) p + k % p, the
  k-th backward the same with the chunks reversed; (p - d - 1) 2 + (v - 1) p forwards to warm up."""
  routes = [[(d, c) for c in range(v) for d in range(p)] for _ in range(m)]
  mb = lambda k: (k // (p * v)) * p + k % p
  forward = lambda k: (Op(F, mb(k), (k // p) % v),)
  backward = lambda k: (Op(B, mb(k), v - 1 - (k // p) % v),)
  orders = []
  for d in range(p):
    warm = min((p - d - 1) * 2 + (v - 1) * p, m * v)
    order = [forward(k) for k in range(warm)]
    for k in range(m * v - warm):
      order += [forward(warm + k), backward(k)]
    orders.append(order + [backward(k) for k in range(m * v - warm, m * v)])
  return routes, orders


def _dual_steps(ranks: int, rank: int, chunks: int):
  """DualPipe's eight steps on one device as (kind, phases, split): phase 0 is the chunk whose micro-batches
  enter nearer this device; `rank` counts from the end of a half (DualPipe) or of the V (DualPipeV), `ranks` is
  that half's length and `chunks` the micro-batches per phase."""
  rest, near = ranks - rank - 1, rank + 1
  steps = [("F", (0,), False)] * (2 * rest)
  steps += [("F", (0,), False), ("F", (1,), False)] * near
  steps += [("B", (1,), True), ("W", (), False), ("F", (1,), False)] * rest
  for i in range(chunks - 2 * ranks + rank + 1):
    first = [("F", (0,), False), ("B", (1,), False)] if i == 0 and rest == 0 else [("FB", (0, 1), False)]
    steps += first + [("FB", (1, 0), False)]
  steps += [("B", (1,), False), ("FB", (1, 0), False)] * rest
  split = False
  for i in range(near):  # the second half of these backwards leave their weights' gradients for later
    split = split or (i == near // 2 and rank % 2 == 1)
    steps.append(("B", (1,), split))
    split = split or (i == near // 2 and rank % 2 == 0)
    steps.append(("B", (0,), split))
  steps += [("W", (), False), ("B", (0,), True)] * rest
  return steps + [("W", (), False)] * near


def _dual_order(steps, chunk_of, first_mb):
  """Slots from `_dual_steps`: each phase's micro-batches in order (`first_mb[chunk]` onwards), the split-off
  weight gradients in the order their backwards ran."""
  count = {(kind, c): first_mb[c] for kind in (F, B) for c in (0, 1)}
  pending, order = [], []
  for kind, phases, split in steps:
    if kind == W:
      order.append((pending.pop(0),))
      continue
    kinds = (F, B) if kind == "FB" else (kind,)
    ops = []
    for k, phase in zip(kinds, phases):
      c = chunk_of(phase)
      ops.append(Op(k, count[(k, c)], c))
      count[(k, c)] += 1
    if split:
      pending.append(Op(W, ops[0].micro_batch, ops[0].chunk))
    order.append(tuple(ops))
  return order


def dualpipe(p: int, m: int, v: int):
  half, n = p // 2, m // 2
  routes = [[(d, 0) for d in range(p)]] * n + [[(d, 1) for d in reversed(range(p))]] * n
  orders = [
    _dual_order(_dual_steps(half, min(d, p - 1 - d), n), lambda ph, s=d >= half: ph ^ s, (0, n)) for d in range(p)
  ]
  return routes, orders


def dualpipev(p: int, m: int, v: int):
  devices = p // 2
  route = [(d, 0) for d in range(devices)] + [(d, 1) for d in reversed(range(devices))]
  orders = [_dual_order(_dual_steps(devices, d, m), lambda ph: ph, (0, 0)) for d in range(devices)]
  return [route] * m, orders
