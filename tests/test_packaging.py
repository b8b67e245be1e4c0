"""pyproject finds every package and its data files; the kernels, configs and programs are plain top-level packages
(no import hook), and import from outside the repository root once installed."""

import fnmatch
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("moejax", "kernels", "configs", "experiments")  # the installed top-level packages


def test_every_package_is_found_under_its_folder_name():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  include = project["tool"]["setuptools"]["packages"]["find"]["include"]
  found = {  # setuptools' find: the folders with an __init__.py whose dotted name matches an include pattern
    ".".join(p.parent.relative_to(ROOT).parts)
    for top in ROOT.iterdir()
    if top.is_dir() and not top.name.startswith(".")
    for p in top.rglob("__init__.py")
    if any(fnmatch.fnmatch(".".join(p.parent.relative_to(ROOT).parts), pattern) for pattern in include)
  }
  on_disk = {".".join(p.parent.relative_to(ROOT).parts) for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")}
  assert found == on_disk and {name.split(".")[0] for name in found} == set(FOLDERS)


def test_nothing_mounts_a_folder_under_another_name():
  """No sys.modules hook: `kernels` is the kernels folder itself, and moejax has no `kernels` attribute."""
  import kernels.gmm as gmm
  import moejax

  assert pathlib.Path(gmm.__file__).resolve().parent == ROOT / "kernels"
  assert "sys.modules" not in (ROOT / "moejax" / "__init__.py").read_text()
  assert not hasattr(moejax, "kernels")


def test_every_data_file_is_package_data():
  """Files a package reads at run time (the measured expert-backend tables, the 2026 families' shapes) match its package-data globs, so a
  wheel carries them."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  data = project["tool"]["setuptools"]["package-data"]
  found = [
    p
    for folder in ("moejax", "configs")  # the packages that read files (experiments' notebook is the user's to open)
    for p in (ROOT / folder).rglob("*")
    if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
  ]
  assert found
  for path in found:
    package = ".".join(path.parent.relative_to(ROOT).parts)
    while package not in data and "." in package:
      package = package.rsplit(".", 1)[0]
    base = ROOT.joinpath(*package.split("."))
    assert any(path.relative_to(base).match(glob) for glob in data.get(package, [])), path


@pytest.mark.slow
def test_configs_and_programs_run_from_outside_the_repository_root(tmp_path):
  """As a user runs them once moejax is installed: from another folder, nothing on PYTHONPATH."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run(
    [
      sys.executable,
      "-c",
      "import configs.decoder as d, experiments.plot_run; print(d.get_config('deepseek_v3').model.family)",
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
      "experiments.train",
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
