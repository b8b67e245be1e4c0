"""Executes experiments/notebooks/quickstart.ipynb in a fresh kernel and checks what it printed.

The kernel is a separate process with its own JAX (the notebook simulates its 8 CPU devices itself),
started from this interpreter (`sys.executable`, so the same virtualenv) through a kernel spec in a
temporary folder: nothing is registered with Jupyter.
"""

import json
import math
import os
import pathlib
import re
import sys

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.slow  # runs the notebook in a kernel

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "notebooks" / "quickstart.ipynb"
ROUTINGS = ("topk", "bilevel")
TOLERANCE = 1e-4
ERROR_LINE = re.compile(r"^(\w+): max relative error vs reference (\S+)", re.MULTILINE)
PREFIX_MARK = "kernel sys.prefix: "


def reference_errors(text: str) -> dict[str, float]:
  """routing -> the relative error the notebook printed for it."""
  return {name: float(value) for name, value in ERROR_LINE.findall(text)}


def check_reference_errors(errors: dict[str, float]) -> None:
  assert sorted(errors) == sorted(ROUTINGS), f"notebook printed reference errors for {sorted(errors)}"
  for name, error in errors.items():
    assert math.isfinite(error) and error < TOLERANCE, f"{name}: relative error {error} vs reference"


def _kernel_manager(kernel_dir: pathlib.Path) -> KernelManager:
  """A manager whose 'python3' kernel is this interpreter, from a kernel spec in `kernel_dir`."""
  spec = kernel_dir / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (moejax test)", "language": "python"}))
  return KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))


def _kernel_env() -> dict[str, str]:
  """The kernel's environment: CPU JAX with no device count forced from outside (the notebook calls
  simulate_cpu_devices), and the repository importable from any working directory."""
  env = dict(os.environ)
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  return env


def _stdout(nb) -> str:
  return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                 if out.get("output_type") == "stream" and out.get("name") == "stdout")


def test_notebook_is_stored_clean():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_check_reference_errors_rejects_bad_output():
  good = "topk: max relative error vs reference 1.9e-07 (x)\nbilevel: max relative error vs reference 2.2e-07\n"
  check_reference_errors(reference_errors(good))
  for bad in (good.replace("2.2e-07", "3.0e-03"), good.replace("2.2e-07", "nan"), good.splitlines()[0]):
    with pytest.raises(AssertionError):
      check_reference_errors(reference_errors(bad))


def test_quickstart_notebook_runs(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell(f"import sys\nprint({PREFIX_MARK!r} + sys.prefix)"))
  workdir = tmp_path / "work"
  workdir.mkdir()
  client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path / "kernels"), timeout=600,
                                   startup_timeout=120, resources={"metadata": {"path": str(workdir)}})
  client.execute(env=_kernel_env())  # raises CellExecutionError if a cell fails

  text = _stdout(nb)
  assert f"{PREFIX_MARK}{sys.prefix}\n" in text, "the kernel ran in another environment"
  check_reference_errors(reference_errors(text))
  images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
  assert len(images) == len(ROUTINGS), "one figure of traffic matrices per routing"
  assert len(re.findall(r"^\w+ hop \d+ over .*: inter-node \d+ rows", text, re.MULTILINE)) == 3  # 1 + 2 hops
