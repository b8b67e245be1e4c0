"""The compute ops of a compiled program, read from XLA's optimised HLO: what each costs in FLOPs and bytes.

`ops(compiled)` lists every instruction the program executes that does work: the top-level instructions of the entry
computation and of the computations it runs through while loops, conditionals and calls (not the bodies of fusions or
reducers: a fusion is one op), each with its runs per program run (`moejax.cost.program`'s count: a while body its
known trip count, a conditional's branch its share). Each op has a category, what a device's rate for it is measured
on (`moejax.study.program_calibration`):

- 'matmul': a dot or convolution, a fusion containing one, a matmul custom-call;
- 'sort': a sort, a TopK custom-call, or a fusion containing a sort;
- 'scatter', 'gather': a scatter or gather, or a fusion containing one (a scatter first);
- 'elementwise': every other op: loop and reduction fusions, copies, transposes, dynamic slices, iotas.

Not listed: parameters, constants, tuples, get-tuple-element, bitcasts, the control ops themselves (their bodies are
listed), and collectives (priced on their own, `moejax.cost.program_price`).

FLOPs: a dot's 2 x output elements x contracted size (its lhs dims named by `lhs_contracting_dims`); a
convolution's 2 x output elements x kernel elements / output features; a matmul custom-call's 2 x output elements x
sqrt(lhs x rhs / output elements) (its contracted size, exact for an unbatched matmul in either layout); a fusion's
the sum of its dots'. Every other op: 0. Bytes: the op's operands plus its output, from the shapes in the text
(a buffer updated in place is counted whole: an upper bound for a dynamic-update-slice).
"""

import dataclasses
import math
import re

from moejax.cost import program as program_lib

CATEGORIES = ("matmul", "gather", "scatter", "sort", "elementwise")
# Ops that do no work of their own, or whose work is priced elsewhere (collectives) or as their bodies (control).
SKIPPED = {
  "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call", "partition-id",
  "replica-id", "after-all", "opt-barrier", "add-dependency", "domain", "async-start", "async-update", "async-done",
  "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
}  # fmt: skip
CONTROL = ("while", "conditional", "call")
_MATMUL_TARGET = re.compile(r"matmul|gemm|\bdot", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Op:
  """One executed instruction. name, opcode: XLA's; category: one of CATEGORIES; flops, bytes: per run, per device
  (module docstring); count: runs per program run (a conditional's branch may run a fraction; None: unknown);
  computation: the computation it is a top-level instruction of."""

  name: str
  opcode: str
  category: str
  flops: float
  bytes: int
  count: float | None
  computation: str


def ops(compiled) -> list[Op]:
  """Every op of `compiled` (a `jax.stages.Compiled`) that does work, in the order of the HLO text."""
  return parse(compiled.as_text())


def parse(hlo: str) -> list[Op]:
  """The ops of an HLO module's text (module docstring)."""
  computations, entry = program_lib.computations_of(hlo)
  runs = program_lib.computation_runs(computations, entry)[0]
  types = {inst[0]: inst[1] for lines in computations.values() for inst in lines}
  found = []
  for computation in executed(computations, entry):
    count = runs[computation]
    for name, type_, opcode, rest in computations[computation]:
      kind = category(opcode, rest, computations)
      if kind is None:
        continue
      found.append(
        Op(name, opcode, kind, flops(opcode, type_, rest, computations, types),
           op_bytes(opcode, type_, rest, computations, types), None if count is None else float(count), computation)
      )  # fmt: skip
  return found


def executed(computations: dict, entry: str) -> list[str]:
  """The entry and every computation it runs through a while, conditional or call (their bodies, conditions and
  branches), in the order of the text."""
  reached, todo = set(), [entry]
  while todo:
    name = todo.pop()
    if name in reached or name not in computations:
      continue
    reached.add(name)
    for _, _, opcode, rest in computations[name]:
      if opcode in CONTROL:
        todo += [callee for callee, _, _ in program_lib.called_computations(opcode, rest)]
  return [name for name in computations if name in reached]


def contents(opcode: str, rest: str, computations: dict) -> set[str]:
  """The opcodes an instruction runs: its own, and for a fusion every opcode of its fused computation (nested
  fusions included)."""
  found = {opcode}
  if opcode == "fusion":
    for callee in re.findall(r"\bcalls=%([\w.\-]+)", rest):
      for _, _, inner, inner_rest in computations.get(callee, []):
        found |= contents(inner, inner_rest, computations)
  return found


def category(opcode: str, rest: str, computations: dict) -> str | None:
  """The op's category (module docstring), or None for an op that is not listed."""
  if opcode in SKIPPED or opcode.removesuffix("-start").removesuffix("-done") in program_lib.KINDS:
    return None
  inside = contents(opcode, rest, computations)
  target = re.search(r'custom_call_target="([^"]*)"', rest) if opcode == "custom-call" else None
  if inside & {"dot", "convolution"} or (target and _MATMUL_TARGET.search(target.group(1))):
    return "matmul"
  if "sort" in inside or (target and target.group(1) == "TopK"):
    return "sort"
  for kind in ("scatter", "gather"):
    if kind in inside:
      return kind
  return "elementwise"


def flops(opcode: str, type_: str, rest: str, computations: dict, types: dict) -> float:
  """The FLOPs of one run of an instruction (module docstring); its output type `type_`, `types` every
  instruction's."""
  if opcode == "dot":
    return dot_flops(type_, rest, types)
  if opcode == "convolution":
    return convolution_flops(type_, rest, types)
  if opcode == "custom-call" and _MATMUL_TARGET.search(re.search(r'custom_call_target="([^"]*)"', rest).group(1)):
    lhs, rhs = (_elements(types.get(o, "")) for o in program_lib.operands(rest)[:2])
    out = _elements(type_)
    return 2.0 * out * math.sqrt(lhs * rhs / out) if out else 0.0
  if opcode == "fusion":
    total = 0.0
    for callee in re.findall(r"\bcalls=%([\w.\-]+)", rest):
      for _, inner_type, inner, inner_rest in computations.get(callee, []):
        total += flops(inner, inner_type, inner_rest, computations, types)
    return total
  return 0.0


def dot_flops(type_: str, rest: str, types: dict) -> float:
  """2 x output elements x contracted size: 'f32[8,16] dot(%a, %b), lhs_contracting_dims={1}' with a: f32[8,4]
  -> 2 x 128 x 4 = 1024."""
  lhs = _dims(types.get(program_lib.operands(rest)[0], ""))
  listed = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
  contracted = math.prod(lhs[int(d)] for d in listed.group(1).split(",") if d) if listed else 1
  return 2.0 * _elements(type_) * contracted


def convolution_flops(type_: str, rest: str, types: dict) -> float:
  """2 x output elements x kernel elements / output features: each output element is a dot over the kernel's window
  and input features (`dim_labels=b01f_01io->b01f`: the kernel's 'o' dim is its output features)."""
  kernel = _dims(types.get(program_lib.operands(rest)[1], ""))
  labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
  # A grouped convolution's kernel holds only its group's input features: the same count holds.
  features = kernel[labels.group(1).index("o")] if labels and kernel else 1
  return 2.0 * _elements(type_) * math.prod(kernel) / max(features, 1)


def op_bytes(opcode: str, type_: str, rest: str, computations: dict, types: dict) -> int:
  """The bytes one run of an instruction reads and writes (module docstring): a fusion's read through its fused
  computation, any other op as a fusion of itself."""
  names = program_lib.operands(rest)
  if opcode != "fusion":
    return _body_bytes([("op", type_, opcode, rest)], {n: _size(types.get(n, "")) for n in names})
  callee = re.search(r"\bcalls=%([\w.\-]+)", rest).group(1)
  body = computations[callee]
  params = {int(re.match(r"(\d+)", r).group(1)): n for n, _, o, r in body if o == "parameter"}
  inputs = {params[i]: _size(types.get(n, "")) for i, n in enumerate(names) if i in params}
  return _body_bytes(body, inputs)


def _body_bytes(body: list[tuple], inputs: dict[str, int]) -> int:
  """Bytes read from `inputs` ({name: bytes}) by the instructions of `body` (its last the root) plus bytes the root
  writes. An input read only through slices, dynamic slices or gathers (operand 0) reads what they take out; one
  updated in place by a scatter or dynamic-update-slice (operand 0) is not read, and the root writes only the
  updates. Every other use reads the whole input; no input is read more than whole."""
  alias, reads, sizes = {}, dict.fromkeys(inputs, 0), {n: _size(t) for n, t, _, _ in body}
  for name, _, opcode, rest in body:
    for position, operand in enumerate(program_lib.operands(rest)):
      source = alias.get(operand, operand)
      if opcode == "bitcast" and source in inputs:
        alias[name] = source
      elif source in inputs:
        sliced = opcode in ("slice", "dynamic-slice", "gather") and position == 0
        in_place = opcode in ("scatter", "dynamic-update-slice") and position == 0
        reads[source] += sizes[name] if sliced else 0 if in_place else inputs[source]
  root = body[-1]
  while root[2] == "bitcast":  # a bitcast root writes what it views
    root = next(inst for inst in body if inst[0] == program_lib.operands(root[3])[0])
  written = sizes[root[0]]
  if root[2] in ("scatter", "dynamic-update-slice"):
    updates = program_lib.operands(root[3])[-1 if root[2] == "scatter" else 1]
    written = inputs.get(alias.get(updates, updates), sizes.get(updates, written))
  return sum(min(inputs[n], reads[n]) for n in inputs) + written


def _size(type_: str) -> int:
  """The bytes of an HLO type (a tuple's summed)."""
  return sum(b for _, b in program_lib.array_bytes(type_))


def _dims(type_: str) -> list[int]:
  """The dims of an HLO array type: 'f32[8,<=4]{1,0}' -> [8, 4]; [] for a tuple or a scalar."""
  found = re.findall(r"\b[a-z]+\d*[a-z0-9]*\[([\d,<=]*)\]", type_)
  if len(found) != 1:
    return []
  return [int(d.removeprefix("<=")) for d in found[0].split(",") if d]


def _elements(type_: str) -> int:
  """The elements of an HLO type (a tuple's summed): 'f32[8,4]{1,0}' -> 32."""
  return sum(
    math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d)
    for dims in re.findall(r"\b[a-z]+\d*[a-z0-9]*\[([\d,<=]*)\]", type_)
  )


def summary(found: list[Op]) -> dict[str, tuple[float | None, float | None, float | None]]:
  """{category: (runs, flops, bytes)} per program run, summed over its ops (None where a count is unknown)."""
  table = {}
  for op in found:
    runs, fl, size = table.get(op.category, (0.0, 0.0, 0.0))
    if runs is None or op.count is None:
      table[op.category] = (None, None, None)
    else:
      table[op.category] = (runs + op.count, fl + op.flops * op.count, size + op.bytes * op.count)
  return table
