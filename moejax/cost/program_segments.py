"""The compute before each collective of a compiled program, and what waiting at the collective after it costs.

`segments(hlo)` maps each collective instruction to its segment: the ops (`moejax.cost.program_ops`) its computation
runs between the collective before it and it (from the computation's start for the first). A collective that
directly follows another has an empty segment.

Why the segment matters: devices that share a host's cores (simulated CPU devices, gloo's processes) finish a segment
at different times, and at the collective every device waits for the last one. The wait grows with the segment and
then saturates. `arrival_seconds` prices it by interpolating in the segment's priced seconds through two calibrated
points `((s1, w1), (s2, w2))` (`moejax.study.arrival_calibration`): 0 at an empty segment, linear up to s1 and
between s1 and s2, flat beyond s2. A collective timed alone as its own program holds one such wait from the call's
start, which is in its alpha; the calibrated points are the excess over that.
"""

import numpy as np

from moejax.cost import program as program_lib
from moejax.cost import program_ops


def segments(hlo: str) -> dict[str, tuple[str, ...]]:
  """{collective instruction's name: the names of the ops before it, back to the collective before it}, in the order
  the program runs them from its entry: a conditional's branch or a loop's body continues the segment of the ops
  before the call, and the ops after its last collective continue into the caller's (a collective first in a
  branch is not free of compute before it). A loop body's collectives take their steady-state segment (the body's ops
  after its last collective, then its condition's, then those before the collective)."""
  computations, entry = program_lib.computations_of(hlo)
  found = {}

  def walk(name: str, since: tuple) -> tuple:
    for inst, _, opcode, rest in computations.get(name, []):
      if opcode.removesuffix("-start").removesuffix("-done") in program_lib.KINDS:
        if not opcode.endswith("-done"):
          found[inst] = since
        since = ()
      elif program_ops.category(opcode, rest, computations) is not None:
        since += (inst,)
      elif opcode in program_ops.CONTROL:
        since = _called(opcode, rest, since, walk)
    return since

  walk(entry, ())
  return found


def _called(opcode: str, rest: str, since: tuple, walk) -> tuple:
  """The segment after a control-flow instruction whose callees `walk` continues from `since`: a loop's body and
  condition walked twice (the second pass, from the first's end, gives the body's collectives their steady state);
  a conditional's branches each from `since`, after it the longest branch's end."""
  calls = program_lib.called_computations(opcode, rest)
  if opcode == "while":
    loop = [name for name, _, _ in calls]
    for _ in range(2):
      end = since
      for name in loop:
        end = walk(name, end)
      since = end if end != since else since
    return since
  ends = [walk(name, since) for name, _, _ in calls]
  return max(ends, key=len, default=since)


def arrival_seconds(points: tuple, segment_s: float) -> float:
  """The wait at a collective after `segment_s` of compute, from calibrated `points` ((s1, w1), (s2, w2)) (module
  docstring); no points: 0."""
  if not points or segment_s <= 0:
    return 0.0
  (s1, w1), (s2, w2) = points
  return float(np.interp(segment_s, [0.0, s1, s2], [0.0, w1, w2]))
