"""experiments/notebooks/quickstart.ipynb: committed with the outputs of one run from top to bottom (so it renders
where the repository is browsed), and executed in a fresh kernel here; both outputs are checked alike (every
comparison with the reference, the capacity drops, the overflowing and then grown receive buffers, the figures), and
the fresh run must print the committed numbers (counts, traffic rows, drops exactly): a notebook committed with
another version's outputs fails.

The kernel is a separate process with its own JAX (the notebook simulates its 8 CPU devices itself),
started from this interpreter (`sys.executable`, so the same virtualenv) through a kernel spec in a
temporary folder: nothing is registered with Jupyter.
"""

import json
import math
import pathlib
import re
import sys

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "notebooks" / "quickstart.ipynb"
ROUTINGS = ("topk", "bilevel")
TOLERANCE = 1e-4
MAX_BYTES = 200_000  # the committed notebook: two small figures and short text
ERROR_LINE = re.compile(r"^(\w+): max relative error vs reference (\S+)", re.MULTILINE)
DROP_LINE = re.compile(
  r"^(\w+) capacity_factor (\S+): (\d+) of (\d+) token-choices dropped \(reference (\d+)\), "
  r"error vs reference (\S+), vs dropless (\S+)$",
  re.MULTILINE,
)
BUFFER_LINE = re.compile(
  r"^(\w+) buffer_factor (\S+): \d+ rows per hop, (\d+) token-choices overflowed, "
  r"error vs reference (\S+)$",
  re.MULTILINE,
)
GROWN_LINE = re.compile(
  r"^(\w+) apply_without_overflow from (\S+): settled on buffer_factor (\S+), (\d+) overflowed, "
  r"error vs reference (\S+)$",
  re.MULTILINE,
)
PREFIX_MARK = "kernel sys.prefix: "
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
FLOAT_RTOL = 0.05  # printed losses and errors with 2-3 digits: the last one may round the other way elsewhere


def reference_errors(text: str) -> dict[str, float]:
  """routing -> the relative error the notebook printed for it."""
  return {name: float(value) for name, value in ERROR_LINE.findall(text)}


def check_reference_errors(errors: dict[str, float]) -> None:
  assert sorted(errors) == sorted(ROUTINGS), f"notebook printed reference errors for {sorted(errors)}"
  for name, error in errors.items():
    assert math.isfinite(error) and error < TOLERANCE, f"{name}: relative error {error} vs reference"


def check_drops(text: str) -> None:
  """Both transports at each capacity factor: the reference's drops exactly, some drops (and so a changed output)
  at the smallest factor, fewer as the factor grows."""
  lines = DROP_LINE.findall(text)
  assert {transport for transport, *_ in lines} == {"padded", "capacity"}, lines
  for transport in ("padded", "capacity"):
    rows = [line[1:] for line in lines if line[0] == transport]
    assert len(rows) >= 2, rows
    dropped = [int(row[1]) for row in rows]
    assert dropped[0] > 0 and dropped == sorted(dropped, reverse=True), rows
    for factor, drops, choices, reference, error, vs_dropless in rows:
      assert drops == reference and int(drops) < int(choices), (transport, factor)
      assert float(error) < TOLERANCE, (transport, factor, error)
    assert float(rows[0][5]) > 0.1, "the smallest capacity changes the output"


def check_buffers(text: str) -> None:
  """Per routing: the smallest bound overflows (and the output leaves the reference's), the largest does not (and
  equals it); apply_without_overflow settles on a larger factor with nothing lost."""
  lines = BUFFER_LINE.findall(text)
  grown = {name: rest for name, *rest in GROWN_LINE.findall(text)}
  assert {name for name, *_ in lines} == set(ROUTINGS) == set(grown), (lines, grown)
  for name in ROUTINGS:
    rows = [(float(b), int(n), float(e)) for routing, b, n, e in lines if routing == name]
    assert rows[0][1] > 0 and rows[0][2] > 0.1, rows
    assert rows[-1][1] == 0 and rows[-1][2] < TOLERANCE, rows
    start, settled, overflowed, error = grown[name]
    assert float(settled) > float(start) and overflowed == "0" and float(error) < TOLERANCE, grown[name]


def check_outputs(nb) -> None:
  """What a run of the notebook printed and drew."""
  text = _stdout(nb)
  check_reference_errors(reference_errors(text))
  check_drops(text)
  check_buffers(text)
  images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
  assert len(images) == len(ROUTINGS), "one figure of traffic matrices per routing"
  assert len(re.findall(r"^\w+ hop \d+ over .*: inter-node \d+ rows", text, re.MULTILINE)) == 3  # 1 + 2 hops
  errors = [out for cell in nb.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors, errors


def check_same_numbers(committed: str, fresh: str) -> None:
  """The fresh run printed the committed lines with the same numbers: integers (counts, rows, bytes, drops) exactly,
  others within FLOAT_RTOL, or both at rounding level (errors against the reference under TOLERANCE)."""
  old = [line for line in committed.splitlines() if line.strip()]
  new = [line for line in fresh.splitlines() if line.strip()]
  assert [NUMBER.sub("#", line) for line in old] == [NUMBER.sub("#", line) for line in new], (
    "the notebook prints other lines than its committed outputs: run it again and commit it"
  )
  for before, now in zip(old, new):
    for a, b in zip(NUMBER.findall(before), NUMBER.findall(now)):
      same = (
        a == b
        if a.lstrip("-+").isdigit() and b.lstrip("-+").isdigit()
        else max(abs(float(a)), abs(float(b))) < TOLERANCE or math.isclose(float(a), float(b), rel_tol=FLOAT_RTOL)
      )
      assert same, f"stale committed output (run the notebook again and commit it): {before!r}, now {now!r}"


def _kernel_manager(kernel_dir: pathlib.Path) -> KernelManager:
  """A manager whose 'python3' kernel is this interpreter, from a kernel spec in `kernel_dir`."""
  spec = kernel_dir / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (moejax test)",
        "language": "python",
      }
    )
  )
  return KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))


def _stdout(nb) -> str:
  return "".join(
    out.get("text", "")
    for cell in nb.cells
    for out in cell.get("outputs", [])
    if out.get("output_type") == "stream" and out.get("name") == "stdout"
  )


def test_notebook_is_committed_with_outputs():
  """Every code cell ran once, in order, in one kernel, and shows what it printed or drew; no timings, no error,
  no path of the machine that ran it."""
  raw = NOTEBOOK.read_text()
  assert len(raw.encode()) < MAX_BYTES, f"{NOTEBOOK.name}: {len(raw.encode())} bytes"
  nb = nbformat.reads(raw, as_version=4)
  nbformat.validate(nb)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not run top to bottom once"
  assert all(cell.outputs for cell in code if "print(" in cell.source or "plt.show()" in cell.source)
  assert not any("execution" in cell.metadata for cell in code), "execution timings committed"
  for path in {str(ROOT), sys.prefix, str(pathlib.Path.home())} - {"/"}:
    assert path not in raw, f"{NOTEBOOK.name} names {path}"
  check_outputs(nb)


def test_check_reference_errors_rejects_bad_output():
  good = "topk: max relative error vs reference 1.9e-07 (x)\nbilevel: max relative error vs reference 2.2e-07\n"
  check_reference_errors(reference_errors(good))
  for bad in (good.replace("2.2e-07", "3.0e-03"), good.replace("2.2e-07", "nan"), good.splitlines()[0]):
    with pytest.raises(AssertionError):
      check_reference_errors(reference_errors(bad))


def test_check_same_numbers_rejects_stale_output():
  text = _stdout(nbformat.read(NOTEBOOK, as_version=4))
  check_same_numbers(text, text)
  check_same_numbers(text, text.replace("1.9e-07", "2.1e-07").replace("aux_loss 0.0102", "aux_loss 0.0103"))
  inter = re.search(r"inter-node (\d+) rows", text)
  stale = text.replace(inter.group(0), f"inter-node {2 * int(inter.group(1))} rows", 1)  # before dedup: twice the rows
  drops = re.sub(r": (\d+) of", lambda m: f": {int(m.group(1)) + 1} of", text, count=1)
  shorter = "\n".join(text.splitlines()[:-1])
  for bad in (stale, drops, shorter):
    with pytest.raises(AssertionError):
      check_same_numbers(bad, text)


def test_drop_and_buffer_checks_reject_bad_output():
  text = _stdout(nbformat.read(NOTEBOOK, as_version=4))
  check_drops(text)
  check_buffers(text)
  wrong_reference = re.sub(r"\(reference (\d+)\)", lambda m: f"(reference {int(m.group(1)) + 1})", text, count=1)
  lost = re.sub(r"(settled on buffer_factor \S+), 0 overflowed", r"\1, 3 overflowed", text, count=1)
  no_capacity = "\n".join(line for line in text.splitlines() if not line.startswith("capacity "))
  for bad, check in ((wrong_reference, check_drops), (no_capacity, check_drops), (lost, check_buffers)):
    with pytest.raises(AssertionError):
      check(bad)


@pytest.mark.slow  # runs the notebook in a kernel
def test_quickstart_notebook_runs(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  committed = _stdout(nb)
  nb.cells.append(nbformat.v4.new_code_cell(f"import sys\nprint({PREFIX_MARK!r} + sys.prefix)"))
  workdir = tmp_path / "work"
  workdir.mkdir()
  client = nbclient.NotebookClient(
    nb,
    km=_kernel_manager(tmp_path / "kernels"),
    timeout=600,
    startup_timeout=120,
    resources={"metadata": {"path": str(workdir)}},
  )
  client.execute(env=helpers.cpu_env())  # raises CellExecutionError if a cell fails

  fresh = _stdout(nb)
  assert f"{PREFIX_MARK}{sys.prefix}\n" in fresh, "the kernel ran in another environment"
  check_outputs(nb)
  check_same_numbers(committed, fresh.replace(f"{PREFIX_MARK}{sys.prefix}\n", ""))
