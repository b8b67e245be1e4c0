"""Each compute op of a compiled program as an HLO module of its own: the op on fresh parameters, its fused and
called computations copied, so a device's time for exactly that op (its shapes, its fusion, its layout) can be
measured alone (`moejax.study.op_timing`).

  modules = standalone_modules(compiled.as_text())   # {op name: (module text, whether XLA optimises it)}

Ops are `moejax.cost.program_ops`' (collectives and control ops excluded). The module is the op's key: two ops
of one program, or of two programs, with the same text are the same work (`distinct`). Every name in it is canonical
(n0, n1, ... in the order they appear; computations' signatures dropped, the parser reads them from their bodies),
and so are metadata and control dependencies: ops that differ only in XLA's numbering share one module.
"""

import re

from moejax.cost import program as program_lib
from moejax.cost import program_ops

_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|comparator)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_DROPPED = re.compile(r",\s*(?:metadata|control-predecessors)=\{[^{}]*\}|,\s*metadata=\{[^{}]*\{[^{}]*\}[^{}]*\}")


def computation_blocks(hlo: str) -> dict[str, list[str]]:
  """{computation name: its lines, header and closing brace included} of an HLO module's text."""
  blocks, current = {}, None
  for line in hlo.splitlines():
    head = program_lib._HEAD.match(line)  # pylint: disable=protected-access
    if head and not line.startswith(" "):
      current = head.group(2)
      blocks[current] = [line]
    elif current is not None:
      blocks[current].append(line)
      if line.startswith("}"):
        current = None
  return blocks


def called(lines: list[str]) -> list[str]:
  """The computations the instructions of `lines` call (fusions, reducers, comparators, branches)."""
  found = []
  for line in lines:
    found += _CALLS.findall(line)
    for branches in _BRANCHES.findall(line):
      found += re.findall(r"%([\w.\-]+)", branches)
  return found


def standalone_modules(hlo: str) -> dict[str, tuple[str, bool]]:
  """{op name: `module_text` of the HLO module that runs that op alone on parameters of its operands' types} for every
  op `program_ops.parse(hlo)` lists."""
  blocks = computation_blocks(hlo)
  computations, _ = program_lib.computations_of(hlo)
  by_name = {inst[0]: inst for lines in computations.values() for inst in lines}
  types = {name: inst[1] for name, inst in by_name.items()}
  modules = {}
  for op in program_ops.parse(hlo):
    _, type_, opcode, rest = by_name[op.name]
    modules[op.name] = module_text(type_, opcode, rest, types, blocks)
  return modules


def module_text(type_: str, opcode: str, rest: str, types: dict, blocks: dict) -> tuple[str, bool]:
  """(the module's text, whether XLA must optimise it) of one op (its output type, opcode and the text after its
  opcode): the op as it stands on parameters of its operands' types, the computations it calls copied, compiled
  without XLA's passes (the op as the program runs it); a custom fusion (a library's matmul, its kind in a backend
  config that the module's import drops) as its fused computation's body, which XLA's passes fuse again (its bitcasts
  read as reshapes)."""
  custom = opcode == "fusion" and "kind=kCustom" in rest
  if custom:
    fused = blocks[re.search(r"\bcalls=%([\w.\-]+)", rest).group(1)][1:-1]
    # Layout assignment refuses bitcasts; between row-major arrays (XLA's default layout) one is a reshape.
    entry = [_DROPPED.sub("", line).replace(" bitcast(", " reshape(") for line in fused]
  else:
    # Each operand becomes a parameter under its own name (`canonical` renames them all).
    operands = dict.fromkeys(program_lib.operands(rest))
    entry = [f"  %{n} = {types[n]} parameter({i})" for i, n in enumerate(operands)]
    entry.append(f"  ROOT %op.root = {type_} {opcode}({_DROPPED.sub('', rest)}")
  todo, needed = called(entry), []
  while todo:
    callee = todo.pop(0)
    if callee not in needed:
      needed.append(callee)
      todo += called(blocks[callee])
  text = []
  for c in (c for c in blocks if c in needed):  # callees before their callers, as the parser reads them
    text += ["", f"%{c} {{", *(_DROPPED.sub("", line) for line in blocks[c][1:])]
  text += ["", "ENTRY %main {", *entry, "}"]
  return "HloModule op\n" + canonical("\n".join(text)) + "\n", custom


def canonical(text: str) -> str:
  """`text` with every %name replaced by n0, n1, ... in the order of first appearance."""
  names = {}
  return re.sub(r"%([\w.\-]+)", lambda m: "%" + names.setdefault(m.group(1), f"n{len(names)}"), text)


def distinct(modules: dict[str, tuple[str, bool]]) -> dict[tuple[str, bool], list[str]]:
  """{module (`standalone_modules`' values): the op names that run it}."""
  found = {}
  for name, text in modules.items():
    found.setdefault(text, []).append(name)
  return found
