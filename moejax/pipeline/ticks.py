"""A schedule's timetable as the pipelined step runs it (`moejax.pipeline.step`), tick by tick: `Plan`.

The step's clock (`TICKS`): every slot one tick, a paired F&B slot one tick too (both run in it), a W none. At each
tick a device runs the forward and the backward its timetable starts then; after it, one transfer per link (the F
outputs, or the B input-gradients, sent the same number of devices on) files what arrives under the (micro-batch,
chunk) the timetable says, in buffers of the fewest rows that hold every entry still to be read.
"""

from typing import NamedTuple

import numpy as np

from moejax.pipeline import schedules
from moejax.pipeline.timetable import B, Durations, F, W

TICKS = Durations(f=1.0, b=1.0, w=0.0, fb=1.0)


def timetable(schedule: str, devices: int, micro_batches: int, virtual_stages: int = 1):
  """The schedule's timetable over `devices` devices (dualpipev's p stages are 2 x its devices), timed in the step's
  ticks."""
  stages = schedules.of(schedule, pipelined=True).stages(devices)
  return schedules.timetable(schedule, stages, micro_batches, virtual_stages, TICKS)


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
