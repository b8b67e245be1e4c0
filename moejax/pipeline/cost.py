"""A schedule's step time: the makespan of its timetable at per-op times that hold compute and all-to-all apart.

`StageCost` gives one stage's (or one device's layers') times for one micro-batch: compute of F, B (whole) and W
(the weights' part), and the all-to-alls of F (dispatch and combine) and B (their gradients). A slot of one op takes
its compute plus its all-to-alls (the exchanges of one micro-batch wait on its own compute and the other way round);
a slot of two ops of different micro-batches (DualPipe's F&B, two-batch overlap's F&F and B&B) takes
max(compute, all-to-all) of the two together: each one's exchanges run under the other's compute. W moves nothing.
The step is `timetable.simulate`'s makespan at these times: no formula per schedule. Not priced: the SMs an
overlapped exchange takes from the compute (DeepSeek-V3 gives 20 of 132 to communication), the pipeline's own
sends between stages, a stage's uneven layers.
"""

import dataclasses

from moejax.pipeline import schedules
from moejax.pipeline.timetable import B, F, I, Op, Timetable, W, simulate


@dataclasses.dataclass(frozen=True)
class StageCost:
  """Seconds, one micro-batch through one stage: compute `f`, `b` (whole backward), `w` (its weights' part), and
  all-to-all `a2a_f` (the forward's dispatch and combine), `a2a_b` (the backward's)."""

  f: float
  b: float
  w: float
  a2a_f: float
  a2a_b: float

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not (isinstance(value, (int, float)) and value >= 0):
        raise ValueError(f"StageCost.{field.name}={value!r}: seconds >= 0")
    if self.w > self.b:
      raise ValueError(f"StageCost.w={self.w!r} exceeds b={self.b!r}: the weights' gradient is part of the backward")

  def _parts(self, kind: str) -> tuple[float, float]:
    return {F: (self.f, self.a2a_f), B: (self.b, self.a2a_b), I: (self.b - self.w, self.a2a_b), W: (self.w, 0.0)}[kind]

  def slot(self, kinds: tuple[str, ...]) -> float:
    """One op: its compute plus its all-to-alls; two: max(compute, all-to-all) of both (`timetable.duration`)."""
    parts = [self._parts(kind) for kind in kinds]
    if len(parts) == 1:
      return sum(parts[0])
    return max(sum(c for c, _ in parts), sum(a for _, a in parts))

  def scaled(self, factor: float) -> "StageCost":
    """Every time times `factor` (a stage of `factor` times the layers)."""
    return StageCost(*(factor * getattr(self, f.name) for f in dataclasses.fields(self)))


def one_device(micro_batches: int, cost: StageCost, two_batch: bool) -> Timetable:
  """No pipeline: one device runs every layer (`cost` is all of them) on each micro-batch, forward then backward;
  with `two_batch`, micro-batches 2i and 2i+1 go together (F&F then B&B: SGLang's two-batch overlap, MaxText's
  batch split), an odd last one alone."""
  groups = [
    tuple(range(i, min(i + (2 if two_batch else 1), micro_batches)))
    for i in range(0, micro_batches, 2 if two_batch else 1)
  ]
  order = [tuple(Op(kind, i, 0) for i in group) for group in groups for kind in (F, B)]
  return simulate("two_batch" if two_batch else "no_overlap", [order], [[(0, 0)]] * micro_batches, cost)


def step_time(schedule: str, stages: int, micro_batches: int, stage: StageCost, virtual_stages: int = 1) -> float:
  """Seconds of one step: the makespan of `schedule`'s timetable at `stage`'s times (an interleaved chunk costs
  1/v of them)."""
  cost = stage.scaled(1.0 / virtual_stages) if virtual_stages > 1 else stage
  return schedules.timetable(schedule, stages, micro_batches, virtual_stages, cost).makespan
