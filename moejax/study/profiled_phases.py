"""A compiled program's time split into phases from one profiled run of it (`jax.profiler`), so that a measured
layer's phases are shares of the same run and add up to it.

Each of the program's instructions has a phase (`phase_of`): a collective is 'inter_node' where its groups span the
'node' axis of a mesh of more than one node, else 'intra_node' (every collective the layer runs: its exchanges, its
size exchanges, its loss reductions); an op whose metadata names the experts' scope (`moejax.moe.experts.SCOPE`) is
'expert'; every other instruction 'other' (routing, plans, permutations, the combine, loops' control).

The profile's events nest on each thread of execution: on XLA's CPU backend the devices' thunks share one pool of
threads (a device is no one thread), a while loop's event holds its body's, a collective's its rendezvous waits; on a
GPU each stream's events are its kernels. Each event's self time (its duration less its children's) goes to the phase
of the nearest enclosing instruction of the program (the executor's own time to 'other'); events outside the
program's execution (the host's Python, the client's waits) count for nothing. The phases are then fractions of the
summed time (`shares`): of busy thread time on a CPU, of kernel time on a GPU, not of the wall clock, which a
measured row multiplies them by.
"""

import glob
import os
import re
import tempfile

import jax

from moejax.cost import program as program_lib
from moejax.moe.experts import SCOPE
from moejax.runtime import mesh as mesh_lib

PHASES = ("inter_node", "intra_node", "expert", "other")
EXECUTOR = "ThunkExecutor::Execute"  # XLA CPU's run of a program's thunks: its own time is the program's
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_SCOPED = re.compile(rf'op_name="[^"]*/{SCOPE}/')


def phase_of(compiled, mesh) -> dict[str, str]:
  """Every instruction of `compiled` (a `jax.stages.Compiled` on `mesh`) by name -> its phase (module docstring)."""
  phases = {}
  for line in compiled.as_text().splitlines():
    name = _NAME.match(line)
    if name:
      phases[name.group(1)] = "expert" if _SCOPED.search(line) else "other"
  crosses = mesh_lib.axis_sizes(mesh)[0] > 1
  for c in program_lib.collectives(compiled, mesh):
    phases[c.name] = "inter_node" if crosses and mesh_lib.NODE in c.axes else "intra_node"
  return phases


def self_times(lines, phases: dict[str, str], keys=PHASES) -> dict[str, float]:
  """Seconds of self time by phase over `lines` (each a list of events with name, start_ns, duration_ns); `phases`
  maps instruction names to one of `keys` (the executor's own time goes to 'other', which `keys` must hold)."""
  totals = dict.fromkeys(keys, 0.0)
  for events in lines:
    stack = []  # (end_ns, phase or None) of the events enclosing the current one
    for event in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
      start, end = event.start_ns, event.start_ns + event.duration_ns
      while stack and start >= stack[-1][0]:
        stack.pop()
      outer_end, outer = stack[-1] if stack else (end, None)
      phase = phases.get(event.name) or outer or ("other" if event.name == EXECUTOR else None)
      if phase is not None:
        totals[phase] += event.duration_ns * 1e-9
      if outer is not None:  # the parent's self time excludes this child
        totals[outer] -= (min(end, outer_end) - start) * 1e-9
      stack.append((end, phase))
  return totals


def covered_seconds(lines, covering: set, program: set) -> tuple[float, float]:
  """(the seconds during which at least one event named in `covering` runs, the seconds from the first event named in
  `program` to the last) over `lines` (each a list of events with name, start_ns, duration_ns): e.g. the part of a
  run's wall that some device of the process spends computing, and the run's wall."""
  spans = sorted((e.start_ns, e.start_ns + e.duration_ns) for events in lines for e in events if e.name in covering)
  ends = [(e.start_ns, e.start_ns + e.duration_ns) for events in lines for e in events if e.name in program]
  covered, reach = 0, None
  for start, end in spans:  # the union of the intervals, in order of their starts
    if reach is None or start > reach:
      covered, reach = covered + end - start, end
    elif end > reach:
      covered, reach = covered + end - reach, end
  window = max(e for _, e in ends) - min(s for s, _ in ends) if ends else 0
  return covered * 1e-9, window * 1e-9


def profiled_lines(compiled, args: tuple, runs: int = 1) -> list[list]:
  """The profile's lines of events (each a list with name, start_ns, duration_ns) over `runs` runs of
  `compiled(*args)` (already run once: nothing compiles under the profile)."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(runs):
        jax.block_until_ready(compiled(*args))
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(path)
  return [list(line.events) for plane in profile.planes for line in plane.lines]


def collective_seconds(compiled, args: tuple, mesh, runs: int = 3) -> dict[str, list[float]]:
  """Each collective instruction of `compiled` (`moejax.cost.program.collectives`, by name) -> the seconds of its
  events in `runs` profiled runs: one per device of this process and run of the instruction (a loop's runs
  each). An event lasts from the device's arrival to its result, so the fastest is about the last device to arrive's
  (the transfer itself) and the others add their wait for it."""
  names = {c.name for c in program_lib.collectives(compiled, mesh)}
  seconds = {name: [] for name in names}
  for events in profiled_lines(compiled, args, runs):
    for event in events:
      if event.name in names:
        seconds[event.name].append(event.duration_ns * 1e-9)
  return seconds


def shares(compiled, args: tuple, mesh) -> dict[str, float]:
  """Each phase's fraction of one run of `compiled(*args)` (already run once: nothing compiles under the profile)."""
  phases = phase_of(compiled, mesh)
  lines = profiled_lines(compiled, args)
  totals = self_times(lines, phases)
  whole = sum(totals.values())
  if whole <= 0:
    raise RuntimeError(f"the profile of {len(lines)} lines holds none of the program's {len(phases)} instructions")
  return {phase: seconds / whole for phase, seconds in totals.items()}
