"""The packages' layers (docs/layout.md#layers): pyproject.toml's import-linter contract holds on the code, and an
import that points up (a copy of the code with one added) breaks it, named in the report."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROOT_PACKAGES = ("moejax", "kernels", "configs", "experiments", "benchmarks")


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
  """`lint-imports` on `root`'s pyproject.toml, its root packages imported from `root` (no cache written)."""
  lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or "lint-imports"
  env = {**os.environ, "PYTHONPATH": str(root)}
  return subprocess.run(
    [lint, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_every_import_points_down():
  done = lint_imports(ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "0 broken" in done.stdout


def test_an_upward_import_is_reported(tmp_path):
  """A copy of the packages (their Python files) in which moejax.models.rope imports moejax.train: the contract
  breaks and the report names that import."""
  only_python = lambda folder, names: [
    n for n in names if not (n.endswith(".py") or os.path.isdir(os.path.join(folder, n))) or n == "__pycache__"
  ]
  for name in ROOT_PACKAGES:
    shutil.copytree(ROOT / name, tmp_path / name, ignore=only_python)
  shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
  assert lint_imports(tmp_path).returncode == 0  # the copy as it is keeps the contract
  rope = tmp_path / "moejax" / "models" / "rope.py"
  rope.write_text(rope.read_text() + "\nfrom moejax.train import optim  # upward: models sit below train\n")
  done = lint_imports(tmp_path)
  assert done.returncode != 0
  assert "BROKEN" in done.stdout and "moejax.models.rope -> moejax.train.optim" in done.stdout, done.stdout
