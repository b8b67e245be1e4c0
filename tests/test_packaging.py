"""pyproject lists every package and its data files; the kernels, configs and programs install under moejax.kernels,
moejax.configs and moejax.experiments (not bare `kernels`, `configs`, `experiments`: PyPI has distributions of those
names), and import from outside the repository root."""

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("kernels", "configs", "experiments")  # top-level folders installed as moejax.<folder>


def test_every_package_is_listed_under_its_installed_name():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  listed = set(project["tool"]["setuptools"]["packages"])
  mapping = project["tool"]["setuptools"]["package-dir"]
  assert mapping == {f"moejax.{folder}": folder for folder in FOLDERS}
  found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moejax").rglob("__init__.py")}
  for folder in FOLDERS:
    found |= {"moejax." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / folder).rglob("__init__.py")}
  assert listed == found
  assert not any(name.split(".")[0] in FOLDERS for name in listed)


def test_kernels_import_as_moejax_kernels():
  import moejax.kernels.gmm as gmm

  assert pathlib.Path(gmm.__file__).resolve().parent == ROOT / "kernels"


def test_every_data_file_is_package_data():
  """Files a package reads at run time (the measured expert-backend tables) match its package-data globs, so a
  wheel carries them."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  data = project["tool"]["setuptools"]["package-data"]
  found = [
    p
    for p in (ROOT / "moejax").rglob("*")
    if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
  ]
  assert found
  for path in found:
    package = ".".join(path.parent.relative_to(ROOT).parts)
    while package not in data and "." in package:
      package = package.rsplit(".", 1)[0]
    base = ROOT.joinpath(*package.split("."))
    assert any(path.relative_to(base).match(glob) for glob in data.get(package, [])), path


def test_configs_and_programs_import_each_other_by_their_installed_names():
  """A config or program that imported `configs` would work only from the repository root."""
  bare = []
  for folder in ("configs", "experiments", "benchmarks"):
    for path in (ROOT / folder).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        names = (
          [a.name for a in node.names]
          if isinstance(node, ast.Import)
          else [node.module or ""]
          if isinstance(node, ast.ImportFrom) and not node.level
          else []
        )
        bare += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FOLDERS]
  assert bare == []


def test_configs_and_programs_run_from_outside_the_repository_root(tmp_path):
  """As a user runs them once moejax is installed: from another folder, nothing on PYTHONPATH."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run(
    [
      sys.executable,
      "-c",
      "import moejax.configs.decoder as d, moejax.experiments.plot_run; "
      "print(d.get_config('deepseek_v3').model.family)",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0 and done.stdout == "deepseek_v3\n", done.stderr[-2000:]
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "moejax.experiments.train",
      f"--config={ROOT / 'configs' / 'gpt.py'}",
      "--config.steps=3",
      "--print_config",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0 and '"steps": 3' in done.stdout, done.stderr[-2000:]
