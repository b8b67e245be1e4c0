"""The collectives of a compiled program, read from XLA's optimised HLO, and XLA's own cost numbers.

`collectives(compiled, mesh)` lists every collective of `jax.jit(f).lower(...).compile()`: its kind (XLA's opcode,
an async `-start` read as its collective), the bytes it moves per device, its replica groups (or a permute's
source-target pairs) as the mesh axes they span, and how many times it runs: a collective inside a while loop's body
runs the loop's trip count times (XLA's `known_trip_count`; None where XLA states none), one inside a conditional's
branch the times the conditional runs split evenly among its branches (exact for a switch on a loop's step, the
padded collective's ring of permutes; None where they do not divide). `summary` adds them up per kind and axes;
`program_cost` returns `compiled.cost_analysis()`'s flops and bytes accessed.

Bytes per device, per run: the whole buffer the collective is over, that is its data operands' bytes (an
all-reduce's, a reduce-scatter's input, an all-to-all's send buffer, a permute's block) or, for an all-gather, its
gathered result (operand x group size). A ragged all-to-all counts its input buffer: an upper bound of what it sends.

Device ids in the HLO are logical: index i is the program's i-th device (its device assignment), whose coordinates
are its position in `mesh.devices`.
"""

import dataclasses
import math
import re
from fractions import Fraction

import numpy as np

# XLA's collective opcodes; '<kind>-start' is the async form of a kind (its '-done' is not counted again).
KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
  "collective-broadcast",
)
# Ops that move no data and run no kernel: between two collectives they leave them a chain (`Collective.chained`).
TRANSPARENT = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,<=]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  kind: XLA's opcode ('all-to-all', ...); name: the instruction's name; bytes: moved per device per run (module
  docstring); dtype: its data's element type ('f32', or 'f32/s32' for mixed operands); axes: the mesh axes its
  groups span, in the mesh's order; groups: its replica groups, or a permute's (source, target) pairs, as logical
  device ids; count: runs per program run (None: unknown); in_loop: inside a while loop's body; in_branch: inside a
  conditional's branch (its count assumes the branches are taken in turn); operands: the arrays it moves, each whole
  (XLA's combiner merges a step's gradient all-reduces into one instruction of many operands, which gloo runs one by
  one; an all-to-all's per-peer pieces are one array: `_independent_arrays`); chained: the op before it in its
  computation's schedule (`TRANSPARENT` ones skipped) is a collective, so its devices meet it together instead of each
  arriving from its own compute.
  """

  kind: str
  name: str
  bytes: int
  dtype: str
  axes: tuple[str, ...]
  groups: tuple[tuple[int, ...], ...]
  count: int | None
  in_loop: bool
  in_branch: bool = False
  operands: int = 1
  chained: bool = False


def collectives(compiled, mesh) -> list[Collective]:
  """Every collective of `compiled` (a `jax.stages.Compiled`) on `mesh`, in the order of the HLO text."""
  return parse(compiled.as_text(), mesh, device_assignment(compiled, mesh))


def device_assignment(compiled, mesh) -> list:
  """The program's devices by logical id: its executable's, where it holds all of them (one process), else the
  mesh's devices in order (what jit assigns to a program over one mesh)."""
  try:
    devices = list(compiled.runtime_executable().local_devices())
  except (AttributeError, NotImplementedError, RuntimeError):  # no runtime executable here
    devices = []
  return devices if len(devices) == mesh.devices.size else list(mesh.devices.flat)


def parse(hlo: str, mesh, assignment=None) -> list[Collective]:
  """The collectives of an HLO module's text, ids read through `assignment` (default: the mesh's devices)."""
  computations, entry = computations_of(hlo)
  types = {inst[0]: inst[1] for lines in computations.values() for inst in lines}
  runs, in_loop, in_branch = computation_runs(computations, entry)
  coords = _coordinates(mesh, list(mesh.devices.flat) if assignment is None else assignment)
  found = []
  for computation, lines in computations.items():
    after_collective = False  # the schedule's previous op (TRANSPARENT ones skipped) was a collective
    for name, type_, opcode, rest in lines:
      kind = opcode.removesuffix("-start")
      if kind not in KINDS:
        if opcode not in TRANSPARENT:
          after_collective = opcode.removesuffix("-done") in KINDS
        continue
      groups = _groups(rest, len(coords))
      arrays = _operand_arrays(kind, rest, types)
      size = sum(b for _, b in arrays) * (len(groups[0]) if kind == "all-gather" else 1)
      count = runs[computation]
      found.append(
        Collective(
          kind=kind,
          name=name,
          bytes=size,
          dtype="/".join(sorted({d for d, _ in arrays})),
          axes=_axes(groups, coords, tuple(mesh.axis_names)),
          groups=groups,
          count=int(count) if count is not None and count.denominator == 1 else None,
          in_loop=in_loop[computation],
          in_branch=in_branch[computation],
          operands=_independent_arrays(kind, len(arrays), len(groups[0])),
          chained=after_collective,
        )
      )
      after_collective = True
  return found


def computations_of(hlo: str) -> tuple[dict[str, list[tuple]], str]:
  """({computation: [(name, type, opcode, rest of line)]}, the entry computation's name)."""
  computations, current, entry = {}, None, None
  for line in hlo.splitlines():
    head = _HEAD.match(line)
    if head and not line.startswith(" "):
      current = head.group(2)
      computations[current] = []
      entry = current if head.group(1) else entry
      continue
    inst = _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line)) if current else None
    if inst:
      computations[current].append(inst.groups())
  return computations, entry


def called_computations(opcode: str, rest: str) -> list[tuple[str, Fraction | None, str]]:
  """The computations one instruction calls: [(computation, its runs per run of the instruction, 'loop' | 'branch' |
  '')]. A while's body runs its known trip count (None: unknown), its condition once more; a conditional's n
  branches 1/n each."""
  if opcode in ("async-done", "async-update"):
    return []  # the same computation as its async-start
  trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
  trip = Fraction(int(trips.group(1))) if trips else None
  calls = []
  for key, name in re.findall(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)", rest
  ):
    if key in ("body", "condition"):
      calls.append((name, trip if key == "body" or trip is None else trip + 1, "loop"))
    else:
      calls.append((name, Fraction(1, 2), "branch") if key.endswith("_computation") else (name, Fraction(1), ""))
  for key in ("branch_computations", "called_computations"):
    listed = re.search(key + r"=\{([^}]*)\}", rest)
    names = re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else []
    branch = key == "branch_computations"
    calls += [(name, Fraction(1, len(names)) if branch else Fraction(1), "branch" * branch) for name in names]
  return calls


def computation_runs(computations: dict, entry: str) -> tuple[dict, dict, dict]:
  """Per computation: runs per run of the entry (a Fraction, or None: unknown), whether inside a loop's body or
  condition, whether inside a conditional's branch."""
  callers = {name: [] for name in computations}
  for caller, lines in computations.items():
    for _, _, opcode, rest in lines:
      for callee, factor, where in called_computations(opcode, rest):
        if callee in callers:
          callers[callee].append((caller, factor, where))
  memo = {entry: (Fraction(1), False, False)}

  def visit(name):
    if name not in memo:
      total, looped, branched = Fraction(0), False, False
      for caller, factor, where in callers[name]:
        runs, caller_looped, caller_branched = visit(caller)
        total = None if total is None or runs is None or factor is None else total + runs * factor
        looped, branched = looped or caller_looped or where == "loop", branched or caller_branched or where == "branch"
      memo[name] = (total, looped, branched)
    return memo[name]

  for name in computations:
    visit(name)
  return ({n: m[0] for n, m in memo.items()}, {n: m[1] for n, m in memo.items()}, {n: m[2] for n, m in memo.items()})


def _groups(rest: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """An instruction's replica groups (explicit, iota `[G,S]<=[dims]T(perm)`, by mesh axes `mesh['a'=2,'b'=4] {'a'}`
  as XLA prints them from jax 0.12, or `{}`: all devices) or its source-target pairs, as logical device ids."""
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
  if pairs:
    return tuple(tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if iota:
    shape, dims = [tuple(map(int, g.split(","))) for g in iota.groups()[:2]]
    ids = np.arange(math.prod(dims)).reshape(dims)
    ids = ids.transpose(tuple(map(int, iota.group(3).split(",")))) if iota.group(3) else ids
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
  by_axes = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
  if by_axes:  # the devices along the named axes of the logical mesh, one group per position on the others
    axes = re.findall(r"'(\w+)'=(\d+)", by_axes.group(1))
    names, ids = [a for a, _ in axes], np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
    named = [names.index(a) for a in re.findall(r"'(\w+)'", by_axes.group(2))]
    rows = ids.transpose([i for i in range(len(names)) if i not in named] + named).reshape(
      -1, math.prod(ids.shape[i] for i in named)
    )
    return tuple(tuple(int(i) for i in row) for row in rows)
  explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
  groups = (
    tuple(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))) if explicit else ()
  )
  return groups or (tuple(range(devices)),)


def _independent_arrays(kind: str, arrays: int, group: int) -> int:
  """The arrays a collective moves independently: its operands, but an all-to-all's in XLA's tuple form hold one
  piece of one array per peer of its group (the pieces of one exchange, not several arrays)."""
  if kind == "all-to-all" and arrays > 1 and arrays % group == 0:
    return arrays // group
  return max(1, arrays)


def _operand_arrays(kind: str, rest: str, types: dict) -> list[tuple[str, int]]:
  """[(dtype, bytes)] of the arrays an instruction's data operands hold (a ragged all-to-all's: its input)."""
  names = operands(rest)
  names = names[:1] if kind == "ragged-all-to-all" else names
  return [array for operand in names for array in array_bytes(types.get(operand, ""))]


def operands(rest: str) -> list[str]:
  """The operand names of an instruction, from the text after its opcode's '(': 'a, %b), k=v' -> ['b']."""
  depth, end = 1, 0
  while depth and end < len(rest):
    depth += {"(": 1, ")": -1}.get(rest[end], 0)
    end += 1
  return re.findall(r"%([\w.\-]+)", rest[: end - 1])


def array_bytes(type_: str) -> list[tuple[str, int]]:
  """[(dtype, bytes)] of each array in an HLO type: 'f32[16,32]{1,0}' -> [('f32', 2048)]; a tuple lists each."""
  found = []
  for dtype, dims in _ARRAY.findall(type_):
    bits = 8 if dtype == "pred" else 0 if dtype == "token" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
    elements = math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d)
    found.append((dtype, (elements * bits + 7) // 8))
  return found


def _coordinates(mesh, assignment) -> list[tuple[int, ...]]:
  """The mesh coordinates of each logical device id."""
  position = {device.id: index for index, device in np.ndenumerate(mesh.devices)}
  return [tuple(int(i) for i in position[device.id]) for device in assignment]


def _axes(groups, coords, axis_names) -> tuple[str, ...]:
  """The mesh axes along which some group's (or pair's) members differ, in the mesh's order."""
  spanned = set()
  for group in groups:
    members = [coords[i] for i in group]
    spanned |= {a for a in range(len(axis_names)) if len({c[a] for c in members}) > 1}
  return tuple(axis_names[a] for a in sorted(spanned))


class Summary(dict):
  """{(kind, axes): (runs, bytes)}: each kind and axes' runs per program run and the bytes they move per device
  (None where a count is unknown); printed as a table."""

  def __str__(self) -> str:
    rows = [("kind", "axes", "runs", "bytes/device")]
    for (kind, axes), (runs, size) in sorted(self.items()):
      rows.append((kind, ",".join(axes) or "-", "?" if runs is None else str(runs), "?" if size is None else str(size)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
      f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}" for r in rows
    )


def summary(found: list[Collective]) -> Summary:
  """The collectives added up per (kind, axes): total runs and total bytes per device (unknown counts: None)."""
  table = Summary()
  for c in found:
    runs, size = table.get((c.kind, c.axes), (0, 0))
    table[(c.kind, c.axes)] = (
      None if runs is None or c.count is None else runs + c.count,
      None if size is None or c.count is None else size + c.bytes * c.count,
    )
  return table


def program_cost(compiled) -> dict[str, float]:
  """XLA's own cost numbers of the program per device (`compiled.cost_analysis()`): 'flops', 'bytes accessed',
  'transcendentals', 'optimal_seconds', those it reports (a negative value, CPU's optimal_seconds, is none)."""
  analysis = compiled.cost_analysis()
  analysis = (analysis[0] if analysis else {}) if isinstance(analysis, (list, tuple)) else (analysis or {})
  keys = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
  return {key: float(analysis[key]) for key in keys if analysis.get(key, -1) >= 0}
