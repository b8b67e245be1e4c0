"""A pipeline schedule's timetable: each device's slots in order, their times found by simulating the dependencies.

A schedule (`moejax.pipeline.schedules`) says only the order of each device's slots and the route of each
micro-batch; `simulate` gives every slot its start and end. A slot holds one op, or a forward and a backward run
together (DualPipe's F&B: one micro-batch's all-to-alls under the other's compute). Ops:
  F  the forward of micro-batch i through one stage,
  B  its backward (the whole backward, or only the input's gradient where the device later runs the stage's W),
  W  the weights' gradient of a backward split in two (zero bubble, DualPipe).
The dependencies, for micro-batch i at position k of its route: F(k) after F(k-1); B(k) after B(k+1), and the
last stage's B after its own F (the loss); W(k) after B(k). A slot starts when its device is free and its ops'
inputs are there (sends are asynchronous and take no time here; their cost is `moejax.pipeline.cost`'s).
"""

import dataclasses

F, B, W = "F", "B", "W"
I = "I"  # a backward whose weights' part is a W slot of its own: its input's gradient only


@dataclasses.dataclass(frozen=True)
class Op:
  """One op of a slot: `kind` (F, B or W) of `micro_batch` through the device's stage `chunk` (its virtual stage:
  0 without interleaving)."""

  kind: str
  micro_batch: int
  chunk: int


@dataclasses.dataclass(frozen=True)
class Durations:
  """Per-op times of one stage: `f`, `b` (the whole backward), `w` (its weights' part; the input's part is b - w),
  `fb` (a forward and a backward run together, DualPipe's F&B; None: f + b, no overlap)."""

  f: float = 1.0
  b: float = 1.0
  w: float = 0.0
  fb: float | None = None

  def __post_init__(self):
    for name in ("f", "b", "w", "fb"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and value >= 0):
        raise ValueError(f"Durations.{name}={value!r}: a time >= 0")
    if self.w > self.b:
      raise ValueError(f"Durations.w={self.w!r} exceeds b={self.b!r}: the weights' gradient is part of the backward")

  def slot(self, kinds: tuple[str, ...]) -> float:
    """A slot's time from its ops' kinds (F, B, I: a backward's input part, W); two kinds: paired (`fb`)."""
    if len(kinds) == 2:
      return self.f + self.b if self.fb is None else self.fb
    return {F: self.f, B: self.b, I: self.b - self.w, W: self.w}[kinds[0]]


@dataclasses.dataclass(frozen=True)
class Slot:
  ops: tuple[Op, ...]
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Timetable:
  """`slots[device]`: that device's slots in order, timed; `routes[i]`: the (device, chunk) of each stage micro-batch
  i passes, first to last."""

  name: str
  routes: tuple[tuple[tuple[int, int], ...], ...]
  slots: tuple[tuple[Slot, ...], ...]
  durations: object  # Durations, or moejax.pipeline.cost.StageCost

  @property
  def makespan(self) -> float:
    return max(slots[-1].end for slots in self.slots) - min(slots[0].start for slots in self.slots)

  def idle(self, device: int) -> float:
    """The device's idle time within the makespan: the bubble."""
    return self.makespan - sum(slot.end - slot.start for slot in self.slots[device])

  def bubble_fraction(self) -> float:
    """Idle over available device time, all devices."""
    return sum(self.idle(d) for d in range(len(self.slots))) / (len(self.slots) * self.makespan)


def _split_backwards(orders) -> set:
  """(device, micro-batch, chunk) of every backward whose weights' part is a W slot of its own."""
  return {
    (d, op.micro_batch, op.chunk) for d, order in enumerate(orders) for ops in order for op in ops if op.kind == W
  }


def duration(ops: tuple[Op, ...], device: int, split: set, durations) -> float:
  """A slot's time: `durations.slot` of its ops' kinds (a split backward's is I)."""
  return durations.slot(
    tuple(I if op.kind == B and (device, op.micro_batch, op.chunk) in split else op.kind for op in ops)
  )


def dependencies(op: Op, device: int, routes) -> list[tuple[str, int, int, int]]:
  """The ops `op` (on `device`) waits for, as (kind, micro-batch, device, chunk)."""
  route = routes[op.micro_batch]
  k = route.index((device, op.chunk))
  if op.kind == F:
    return [(F, op.micro_batch, *route[k - 1])] if k else []
  if op.kind == B:
    return [(F, op.micro_batch, device, op.chunk)] + (
      [(B, op.micro_batch, *route[k + 1])] if k + 1 < len(route) else []
    )
  return [(B, op.micro_batch, device, op.chunk)]


def simulate(name: str, orders, routes, durations) -> Timetable:
  """Times `orders` (per device, its slots in order, each a tuple of ops) at `durations` (`Durations`, or anything
  with its `slot`: `moejax.pipeline.cost.StageCost`): each slot as early as its device and its ops' dependencies
  allow. A schedule whose devices wait on each other forever is a ValueError naming them."""
  split = _split_backwards(orders)
  done: dict[tuple, float] = {}
  timed = [[] for _ in orders]
  free = [0.0] * len(orders)
  while any(len(timed[d]) < len(order) for d, order in enumerate(orders)):
    progressed = False
    for d, order in enumerate(orders):
      while len(timed[d]) < len(order):
        ops = order[len(timed[d])]
        needs = [dep for op in ops for dep in dependencies(op, d, routes)]
        if any(dep not in done for dep in needs):
          break
        start = max([free[d]] + [done[dep] for dep in needs])
        free[d] = start + duration(ops, d, split, durations)
        for op in ops:
          done[(op.kind, op.micro_batch, d, op.chunk)] = free[d]
        timed[d].append(Slot(tuple(ops), start, free[d]))
        progressed = True
    if not progressed:
      stuck = {d: order[len(timed[d])] for d, order in enumerate(orders) if len(timed[d]) < len(order)}
      raise ValueError(f"schedule {name} deadlocks: each device's next slot waits on another's: {stuck}")
  return Timetable(name, tuple(map(tuple, routes)), tuple(map(tuple, timed)), durations)


def check(timetable: Timetable) -> None:
  """Raises ValueError naming the first wrong slot: an op missing or repeated, on a device its route does not
  put it on, starting before its inputs are done or before the device's previous slot ends."""
  ends, seen = {}, set()
  for d, slots in enumerate(timetable.slots):
    for slot in slots:
      for op in slot.ops:
        key = (op.kind, op.micro_batch, d, op.chunk)
        if (d, op.chunk) not in timetable.routes[op.micro_batch]:
          raise ValueError(f"{timetable.name}: device {d} runs {op}, whose route does not pass it")
        if key in seen:
          raise ValueError(f"{timetable.name}: device {d} runs {op} twice")
        seen.add(key)
        ends[key] = slot.end
  split = _split_backwards([[s.ops for s in slots] for slots in timetable.slots])
  for d, slots in enumerate(timetable.slots):
    for i, slot in enumerate(slots):
      if i and slot.start < slots[i - 1].end:
        raise ValueError(f"{timetable.name}: device {d}'s slot {i} {slot.ops} starts before its slot {i - 1} ends")
      if abs(slot.end - slot.start - duration(slot.ops, d, split, timetable.durations)) > 1e-9:
        raise ValueError(
          f"{timetable.name}: device {d}'s slot {i} {slot.ops} lasts {slot.end - slot.start}, not its ops' time"
        )
      for op in slot.ops:
        for dep in dependencies(op, d, timetable.routes):
          if dep not in ends or ends[dep] > slot.start:
            raise ValueError(
              f"{timetable.name}: device {d}'s slot {i} runs {op} at {slot.start} before its input "
              f"{dep} is done ({ends.get(dep, 'never')})"
            )
  for i, route in enumerate(timetable.routes):
    for d, c in route:
      for kind in (F, B) + ((W,) if (d, i, c) in split else ()):
        if (kind, i, d, c) not in seen:
          raise ValueError(f"{timetable.name}: device {d} never runs {Op(kind, i, c)}")


def draw(timetable: Timetable, width: int = 4) -> str:
  """The timetable as text, a line per device, `width` characters per unit of time: each slot its ops (F3: the
  forward of micro-batch 3 through the device's chunk 0, F3' its chunk 1, F3B5': a paired slot), '.' idle; a slot
  too short for its label is cut."""
  lines = []
  for d, slots in enumerate(timetable.slots):
    line = ""
    for slot in slots:
      line += "." * (round(slot.start * width) - len(line))
      label = "".join(f"{op.kind}{op.micro_batch}" + "'" * op.chunk for op in slot.ops)
      cells = round(slot.end * width) - len(line)
      line += (label + " " * cells)[: cells - 1] + "|" if cells else ""
    lines.append(f"{d:>2} {line}")
  return "\n".join(lines)


def figure(timetables: list[Timetable]):
  """The timetables as a picture: a panel per timetable, a row per device, each slot a box from its start to its end
  labelled as `draw` labels it (forwards blue, backwards orange, weight gradients green, paired slots purple; a
  chunk-1 op lighter), idle time blank. Returns the matplotlib Figure."""
  from matplotlib.figure import Figure  # only the picture needs matplotlib

  colours = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
  fig = Figure(figsize=(12, 1.0 + 0.45 * sum(len(t.slots) + 1 for t in timetables)), layout="constrained")
  axes = fig.subplots(len(timetables), 1, squeeze=False, height_ratios=[len(t.slots) for t in timetables])[:, 0]
  for ax, table in zip(axes, timetables):
    for d, slots in enumerate(table.slots):
      for slot in slots:
        paired = len(slot.ops) > 1
        colour = "#8172b2" if paired else colours[slot.ops[0].kind]
        ax.barh(
          d,
          slot.end - slot.start,
          left=slot.start,
          height=0.8,
          color=colour,
          alpha=0.55 if slot.ops[0].chunk else 1.0,
          edgecolor="white",
          linewidth=0.5,
        )
        label = "".join(f"{op.kind}{op.micro_batch}" + "'" * op.chunk for op in slot.ops)
        ax.text((slot.start + slot.end) / 2, d, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(table.slots)), [f"device {d}" for d in range(len(table.slots))], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(slot.end for slots in table.slots for slot in slots))
    ax.set_title(f"{table.name}: bubble {table.bubble_fraction():.3f} of the devices' time", fontsize=9, loc="left")
  axes[-1].set_xlabel("time (units of a stage's forward)")
  return fig
