"""What a pipeline schedule keeps in flight on each device, counted from its timetable: for the memory planner.

A micro-batch's activations of one stage (what its backward reads) are made by its F and held until the last op
that reads them: its B, or its W where the backward is split (the weights' gradient reads the stage's inputs too).
A slot's forward makes its activations before its paired backward frees any (DualPipe's F&B holds both at once).
"""

from moejax.pipeline import schedules
from moejax.pipeline.timetable import B, F, Timetable, W


def activations_in_flight(table: Timetable) -> list[float]:
  """Per device, the most stage-activations of micro-batches it holds at once, in units of one stage's activations
  of one micro-batch (an interleaved chunk's count 1/v: a chunk is 1/v of a stage's layers)."""
  chunks = len({c for route in table.routes for _, c in route})
  schedule = schedules.SCHEDULES.get(table.name)  # none for a table of `cost.one_device`
  per_chunk = 1.0 / chunks if schedule is not None and schedule.chunked else 1.0
  last = {}  # (device, micro-batch, chunk) -> the kind of the op that frees its activations
  for d, slots in enumerate(table.slots):
    for slot in slots:
      for op in slot.ops:
        if op.kind == W or (op.kind == B and (d, op.micro_batch, op.chunk) not in last):
          last[(d, op.micro_batch, op.chunk)] = op.kind
  peaks = []
  for d, slots in enumerate(table.slots):
    live, peak = set(), 0
    for slot in slots:
      live |= {(op.micro_batch, op.chunk) for op in slot.ops if op.kind == F}
      peak = max(peak, len(live))
      live -= {(op.micro_batch, op.chunk) for op in slot.ops if last.get((d, op.micro_batch, op.chunk)) == op.kind}
    peaks.append(peak * per_chunk)
  return peaks


def per_device(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> dict:
  """What the planner multiplies, for `schedule` over `stages` stages: `parameter_stages` (stages' parameters a
  device holds, `Schedule.parameter_stages`: 1; DualPipe's d and p-1-d, 2x (DeepSeek-V3 report Table 2); DualPipeV's
  two stages on each of p/2 devices, 2; interleaved's v chunks of 1/v stage, 1), `activation_stages` (the busiest
  device's stage-activations in flight, from the
  timetable), and `layers_fraction` (1/stages: a stage's share of the decoder's layers). A device's bytes:
  parameter_stages x layers_fraction x the layers' parameters (optimizer state alike), and activation_stages x
  layers_fraction x one micro-batch's activations of all layers. The first stage adds the embeddings, the last the
  head, MTP modules and loss."""
  table = schedules.timetable(schedule, stages, micro_batches, virtual_stages)
  return {
    "parameter_stages": schedules.of(schedule).parameter_stages,
    "activation_stages": max(activations_in_flight(table)),
    "layers_fraction": 1.0 / stages,
  }
