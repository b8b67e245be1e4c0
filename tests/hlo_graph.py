"""Data dependencies of an HLO module's entry computation, read from its text (tests only)."""

import re


def entry_graph(hlo: str):
  """({name: (opcode, result type, operands, called computations)}, {name: ancestors}, {computation: lines})."""
  bodies, current, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      current = head.group(2)
      bodies[current] = []
      entry = current if head.group(1) else entry
    elif current and line.startswith("  ") and " = " in line:
      bodies[current].append(re.sub(r"/\*.*?\*/", "", line.strip()))
  nodes = {}
  for line in bodies[entry]:
    name, type_, op, rest = re.match(r"(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) ([a-z\-]+)\((.*)", line).groups()
    called = called_computations(line)
    operands = [o for o in re.findall(r"%([\w.\-]+)", rest) if o not in called]
    nodes[name] = (op, type_, operands, called)
  ancestors = {}
  for name in nodes:  # instructions are printed after their operands
    ancestors[name] = set().union(*([{o} | ancestors.get(o, set()) for o in nodes[name][2] if o in nodes] or [set()]))
  return nodes, ancestors, bodies


def contains(bodies: dict, computation: str, opcode: str) -> bool:
  """Whether a computation (or one it calls) holds an instruction with this opcode."""
  lines = bodies.get(computation, [])
  if any(f" {opcode}(" in line for line in lines):
    return True
  return any(contains(bodies, c, opcode) for line in lines for c in called_computations(line))


def called_computations(line: str) -> list[str]:
  """The computations an instruction calls: fusions and calls, reductions' and scatters' combiners, a while
  loop's condition and body, a conditional's branches."""
  branches = re.search(r"branch_computations=\{([^}]*)\}", line)
  return re.findall(r"(?:calls|to_apply|condition|body)=%([\w.\-]+)", line) + (
    re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
  )


def float_exchanges(nodes: dict, bodies: dict) -> dict[str, int]:
  """{entry instruction: payload columns} of every float exchange: a collective permute, or a loop of them (the
  padded ring, `collective.padded_all_to_all`), whose payload is its first 2-D f32 buffer (the rows it receives)."""
  found = {}
  for name, (op, type_, _, called) in nodes.items():
    payload = re.search(r"f32\[\d+,(\d+)\]", type_)
    if payload and (op == "collective-permute" or any(contains(bodies, c, "collective-permute") for c in called)):
      found[name] = int(payload.group(1))
  return found
