"""The house's size limits (issue 60), checked on every source file: a module of at most 300 lines, a function of
at most 60 (configs' `get_config`s are tables of settings, not logic, and are exempt from the second)."""

import ast

from tests.helpers import ROOT

PACKAGES = ("moejax", "kernels", "experiments", "configs")
MODULE_LINES = 300
FUNCTION_LINES = 60


def _sources():
  return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
  """(name, lines) of each function or method in `source` longer than `limit` lines, decorators excluded."""
  return [
    (node.name, node.end_lineno - node.lineno + 1)
    for node in ast.walk(ast.parse(source))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
  ]


def test_long_functions_are_found():
  body = "\n".join(f"    x{i} = {i}" for i in range(61))
  source = f"def short():\n  return 1\n\n\nclass C:\n  def long(self):\n{body}\n"
  assert long_functions(source, FUNCTION_LINES) == [("long", 62)]


def test_modules_and_functions_keep_to_their_limits():
  over = []
  for path in _sources():
    text = path.read_text()
    name = str(path.relative_to(ROOT))
    if len(text.splitlines()) > MODULE_LINES:
      over.append(f"{name}: {len(text.splitlines())} lines")
    exempt = path.parts[-2] == "configs"
    over += [f"{name}: {f}() {n} lines" for f, n in long_functions(text, FUNCTION_LINES) if not exempt]
  assert not over, f"over {MODULE_LINES} lines a module or {FUNCTION_LINES} a function:\n" + "\n".join(over)
