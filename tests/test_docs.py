"""README and docs: `.ci/run` finds and runs README's marked test command (and fails loudly without one),
README starts with its two commands, every relative link, repository path, bare file name and module
reference (`moejax.moe.path.hop_sizes`, or by a suffix of the module's name: `path.hop_sizes`) the docs name
exists, docs/layout.md names every module and program, and docs/testing.md every test file."""

import ast
import dataclasses
import pathlib
import re
import shutil
import subprocess

import pytest

from moejax.moe.config import MoEConfig
from moejax.pipeline import section as pipeline_section
from moejax.train import guard

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = "<!-- test command -->"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = (".ci", "benchmarks", "configs", "docs", "experiments", "kernels", "moejax", "tests")


def run_ci(tmp_path, readme: str) -> subprocess.CompletedProcess:
  """.ci/run in a copy of the repository that holds only it, `readme` as README.md and, as .ci/e2e and
  .ci/newest-jax, stand-ins that say they ran."""
  (tmp_path / ".ci").mkdir()
  shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
  (tmp_path / ".ci" / "e2e").write_text("echo e2e ran\n")
  (tmp_path / ".ci" / "newest-jax").write_text("echo newest-jax ran\n")
  (tmp_path / "README.md").write_text(readme)
  return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)


def top_commands(text: str) -> list[str]:
  """The lines of README's fenced blocks before its first heading after the title."""
  head = text.split("\n## ", 1)[0]
  return [line for block in re.findall(r"```bash\n(.*?)```", head, re.S) for line in block.splitlines()]


def test_readme_starts_with_the_main_job_then_the_marked_test_command():
  text = (ROOT / "README.md").read_text()
  commands = top_commands(text)
  assert len(commands) == 2 and "experiments.scaling" in commands[0] and "pytest" in commands[1], commands
  assert [line.strip() for line in text.splitlines()].count(MARKER) == 1
  assert f"{MARKER}\n```bash\n{commands[1]}\n```" in text


def test_ci_runs_what_readme_marks(tmp_path):
  """README's own layout with its test command swapped for a harmless one: .ci/run runs exactly that line."""
  text = (ROOT / "README.md").read_text()
  readme = text.replace(top_commands(text)[1], "echo ran > ran.txt && echo 'quoted arg'")
  result = run_ci(tmp_path, readme)
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == [
    "+ echo ran > ran.txt && echo 'quoted arg'",
    "quoted arg",
    "e2e ran",
    "newest-jax ran",
  ]
  assert (tmp_path / "ran.txt").read_text() == "ran\n"


def test_ci_fails_with_the_command(tmp_path):
  result = run_ci(tmp_path, f"# x\n\n```bash\necho main\n```\n{MARKER}\n\n```bash\nexit 3\n```\n")
  assert result.returncode == 3 and result.stdout == "+ exit 3\n"


@pytest.mark.parametrize(
  "readme,reason",
  [
    ("# x\n\n```bash\necho main\necho tests\n```\n", "no marker line"),
    (f"{MARKER}\necho tests\n", "not followed by a ```bash block"),
    (f"{MARKER}\n```bash\necho a\necho b\n```\n", "more than one line"),
    (f"{MARKER}\n```bash\n```\n", "empty"),
    (f"{MARKER}\n```bash\necho a\n", "not closed"),
    (f"{MARKER}\n```bash\necho a\n```\n{MARKER}\n```bash\necho b\n```\n", "appears 2 times"),
  ],
  ids=["no-marker", "no-block", "two-lines", "empty", "unclosed", "two-markers"],
)
def test_ci_fails_without_one_marked_command(tmp_path, readme, reason):
  result = run_ci(tmp_path, readme)
  assert result.returncode == 1 and result.stdout == ""
  assert reason in result.stderr and "no test command found in README.md" in result.stderr


def _links(path: pathlib.Path, text: str):
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if not re.match(r"[a-z]+:", target):
      yield target


def _module_names(path: pathlib.Path) -> set[str]:
  """Names a module defines at its top level (functions, classes, assignments, imports)."""
  names = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
  if path.name == "__init__.py" and "\n_PUBLIC = {" in path.read_text():  # a lazily exported public API
    names.update(ast.literal_eval(re.search(r"_PUBLIC = (\{.*?\})", path.read_text(), re.S).group(1)))
  return names


def _resolves(dotted: str) -> bool:
  """`moejax.a.b.name` (or `experiments.x`): a module file, or a module and a name it defines."""
  parts = dotted.split(".")
  if parts[0] == "moejax" and len(parts) > 1 and parts[1] in ("kernels", "configs", "experiments"):
    parts = parts[1:]  # top-level folders installed under moejax (pyproject.toml)
  for cut in range(len(parts), 0, -1):
    base = ROOT.joinpath(*parts[:cut])
    module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if module.is_file():
      rest = parts[cut:]
      return not rest or rest[0] in _module_names(module)
  return False


def _sources() -> list[pathlib.Path]:
  return [p for d in ("moejax", "kernels", "experiments", "configs", "benchmarks") for p in (ROOT / d).rglob("*.py")]


FILE_NAMES = {p.name for d in TOP_DIRS for p in (ROOT / d).rglob("*") if p.is_file()} | {
  p.name for p in ROOT.iterdir() if p.is_file()
}
# Every dotted suffix of every module's name ('moejax.moe.path' -> 'path', 'moe.path', 'moejax.moe.path'), and the
# module files it may stand for: how the docs name a module when the package is plain from the context.
MODULE_SUFFIXES: dict[str, list[pathlib.Path]] = {}
for _file in _sources():
  _parts = list(_file.relative_to(ROOT).with_suffix("").parts)
  _parts = _parts[:-1] if _parts[-1] == "__init__" else _parts
  _parts = ["moejax", *_parts[1:]] if _parts[0] == "kernels" else _parts
  for _cut in range(len(_parts)):
    MODULE_SUFFIXES.setdefault(".".join(_parts[_cut:]), []).append(_file)
# Names that begin values and config sections in the docs (`cfg.top_k`, `data.tokenizer_model`), not modules.
NOT_MODULES = {
  "cfg",
  "config",
  "aux",
  "model",
  "moe_cfg",
  "params",
  "args",
  "self",
  "np",
  "jnp",
  "jax",
  "data",
  "mesh",
  "optim",
  "log",
  "checkpoint",
  "measure",
  "sim",
  "planner",
  "generate",
  "traffic",
}
MOE_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)} | {"transport"}
# Config sections named like a package of moejax: `<section>.<field>` names a field, else a module of the package.
SECTION_FIELDS = {
  "moe": MOE_FIELDS,
  "pipeline": set(pipeline_section.CONFIG_FIELDS),
  "train": set(guard.CONFIG_FIELDS),
}


def _short_reference_resolves(dotted: str) -> bool:
  """`path.hop_sizes`, `moe.schedule.run`: a module named by a suffix of its dotted name (as the docs do when the
  package is plain), then a name one of the modules it may be defines, or a module under it."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    files = MODULE_SUFFIXES.get(".".join(parts[:cut]))
    if files:
      rest = parts[cut:]
      return not rest or any(rest[0] in _module_names(f) for f in files)
  return True  # not one of ours (a library, an attribute of a value): nothing to check


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(doc):
  text = doc.read_text()
  missing = []
  for target in _links(doc, text):
    file, _, anchor = target.partition("#")
    where = (doc.parent / file).resolve() if file else doc
    if not where.exists():
      missing.append(target)
    elif anchor and where.suffix == ".md":
      headings = re.findall(r"^#+ (.+)$", where.read_text(), re.M)
      slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
      if anchor not in slugs:
        missing.append(target)
  for span in re.findall(r"`([^`\n]+)`", text):
    for token in span.split():
      token = token.rstrip(".,;:)").split(":")[0]
      if re.search(r"[<>{}*$]", token):
        continue
      if token.split("/")[0] in TOP_DIRS and "/" in token and not (ROOT / token).exists():
        missing.append(token)
      elif re.fullmatch(r"(moejax|experiments)(\.\w+)+", token):
        if not _resolves(token):
          missing.append(token)
      elif re.fullmatch(r"[\w\-]+\.(py|md|sh|json|jsonl|ipynb|toml|png|log)", token):
        if token not in FILE_NAMES and not re.search(r"\.(json|jsonl|png|log)$", token):
          missing.append(token)  # a bare file name: some file of the repository has it (outputs are made by runs)
      elif token.split(".")[0] in SECTION_FIELDS and not _short_reference_resolves(token.split("=")[0]):
        section, field = token.split("=")[0].split(".")[:2]
        if field not in SECTION_FIELDS[section]:
          missing.append(token)  # neither a module of moejax.<section> nor a field of the config's section
      elif (
        re.fullmatch(r"[a-z_]\w*(\.\w+)+", token)
        and token.split(".")[0] not in NOT_MODULES
        and not _short_reference_resolves(token)
      ):
        missing.append(token)
  assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


LAYOUT_DIRS = ("moejax", "experiments", "configs", "kernels")


def _files(dirs, pattern: str) -> list[str]:
  """The repository's files under `dirs` matching `pattern`, tracked or new (git ls-files: not the ignored ones), as
  paths relative to the root; every such file where git is not there."""
  try:
    listed = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *dirs],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.splitlines()
  except (OSError, subprocess.CalledProcessError):
    listed = [p.relative_to(ROOT).as_posix() for d in dirs for p in (ROOT / d).rglob("*") if p.is_file()]
  return sorted({f for f in listed if pathlib.PurePosixPath(f).match(pattern) and (ROOT / f).is_file()})


def _layout_bullets(text: str) -> dict[str, str]:
  """The top-level bullets of layout.md's Layout section by the folder of the path each starts with
  ('- `moejax/moe/`: ...' -> 'moejax/moe/', '- `moejax/__init__.py`: ...' -> 'moejax/')."""
  section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
  bullets = {}
  for bullet in re.split(r"\n(?=- `)", section):
    start = re.match(r"\s*- `([^`]+)`", bullet)
    if start:
      path = start.group(1)
      bullets[path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"] = bullet
  return bullets


def _unnamed_in_layout(text: str, files: list[str]) -> list[str]:
  """The files layout.md does not name: by their path anywhere, or in the bullet of their folder (the longest that
  holds them) by a backticked name, module name or path ending (`heldout.py`, `schemes`, `papers/smile.py`). A
  program's config, configs/<name>.py of experiments/<name>.py or benchmarks/<name>.py, is named by its program's
  line ('one file per program, named as the program')."""
  bullets = _layout_bullets(text)
  missing = []
  for file in files:
    if file in text:
      continue
    name = file.rsplit("/", 1)[-1]
    if file.startswith("configs/") and any((ROOT / d / name).is_file() for d in ("experiments", "benchmarks")):
      continue
    folder = max((f for f in bullets if file.startswith(f)), key=len, default=None)
    tokens = {
      token.strip(".,;:()").rsplit("/", 1)[-1]
      for span in re.findall(r"`([^`\n]+)`", bullets.get(folder, ""))
      for token in span.split()
    }
    if not {name, name.removesuffix(".py")} & tokens:
      missing.append(file)
  return missing


def test_layout_names_every_module_and_program():
  text = (ROOT / "docs" / "layout.md").read_text()
  files = [f for f in _files(LAYOUT_DIRS, "*.py") if not f.endswith("__init__.py")]
  assert "moejax/train/heldout.py" in files and "experiments/export.py" in files  # the listing found them
  assert _unnamed_in_layout(text, files) == [], "docs/layout.md: name these, one line each, in their folder's bullet"
  # Would fail on a missing one: a module whose name appears only in another folder's bullet, a program, a sweep.
  for file, name in [
    ("moejax/pipeline/memory.py", "`memory.py`"),
    ("experiments/export.py", "`export.py`"),
    ("configs/scaling_smile.py", "`scaling_smile.py`"),
  ]:
    assert _unnamed_in_layout(text.replace(name, "`elsewhere.py`"), [file]) == [file]


def test_testing_names_every_test_file():
  text = (ROOT / "docs" / "testing.md").read_text()
  tests = _files(["tests"], "tests/test_*.py")
  assert "tests/test_docs.py" in tests
  assert [f for f in tests if f"`{f}`" not in text] == [], "docs/testing.md: say what these test, against what"
