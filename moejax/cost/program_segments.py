"""The compute before each collective of a compiled program, and what waiting at the collective after it costs.

`segments(hlo)` maps each collective instruction to its segment: the ops (`moejax.cost.program_ops`) the program runs
between the collective before it and it, in the order it runs them from its entry (into a conditional's branch or a
loop's body, and back out). A collective that directly follows another has an empty segment.

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

  def walk(name: str, since: tuple) -> tuple[tuple, bool]:
    """(the segment after computation `name` run from `since`, whether it ran a collective)."""
    crossed = False
    for inst, _, opcode, rest in computations.get(name, []):
      if opcode.removesuffix("-start").removesuffix("-done") in program_lib.KINDS:
        if not opcode.endswith("-done"):
          found[inst] = since
        since, crossed = (), True
      elif program_ops.category(opcode, rest, computations) is not None:
        since += (inst,)
      elif opcode in program_ops.CONTROL:
        since, inner = _called(opcode, rest, since, walk)
        crossed = crossed or inner
    return since, crossed

  walk(entry, ())
  return found


def _called(opcode: str, rest: str, since: tuple, walk) -> tuple[tuple, bool]:
  """(the segment after a control-flow instruction whose callees `walk` continues from `since`, whether they ran a
  collective): a loop's condition and body walked twice (the second pass, from the first's end, gives the body's
  collectives their steady state); a conditional's branches each from `since`, after it the end of its longest
  branch among those that ran a collective (the exchange steps a ring's loop takes in turn), else of its longest."""
  calls = [name for name, _, _ in program_lib.called_computations(opcode, rest)]
  if opcode == "while":
    crossed = False
    for _ in range(2):
      for name in calls:
        since, inner = walk(name, since)
        crossed = crossed or inner
    return since, crossed
  ends = [walk(name, since) for name in calls]
  crossing = [end for end, inner in ends if inner]
  return max(crossing or [end for end, _ in ends], key=len, default=since), bool(crossing)


def arrival_seconds(points: tuple, segment_s: float) -> float:
  """The wait at a collective after `segment_s` of compute, from calibrated `points` ((s1, w1), (s2, w2)) (module
  docstring); no points: 0."""
  if not points or segment_s <= 0:
    return 0.0
  (s1, w1), (s2, w2) = points
  return float(np.interp(segment_s, [0.0, s1, s2], [0.0, w1, w2]))
