"""pyproject lists every package and its data files, and the kernels install under moejax.kernels (not a bare
`kernels`)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_listed_under_its_installed_name():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  listed = set(project["tool"]["setuptools"]["packages"])
  mapping = project["tool"]["setuptools"]["package-dir"]
  assert mapping == {"moejax.kernels": "kernels"}
  found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moejax").rglob("__init__.py")}
  found |= {"moejax." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kernels").rglob("__init__.py")}
  assert listed == found
  assert not any(name == "kernels" or name.startswith("kernels.") for name in listed)


def test_kernels_import_as_moejax_kernels():
  import moejax.kernels.gmm as gmm

  assert pathlib.Path(gmm.__file__).resolve().parent == ROOT / "kernels"


def test_every_data_file_is_package_data():
  """Files a package reads at run time (the measured expert-backend tables) match its package-data globs, so a
  wheel carries them."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  data = project["tool"]["setuptools"]["package-data"]
  found = [p for p in (ROOT / "moejax").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
           and "__pycache__" not in p.parts]
  assert found
  for path in found:
    package = ".".join(path.parent.relative_to(ROOT).parts)
    while package not in data and "." in package:
      package = package.rsplit(".", 1)[0]
    base = ROOT.joinpath(*package.split("."))
    assert any(path.relative_to(base).match(glob) for glob in data.get(package, [])), path
