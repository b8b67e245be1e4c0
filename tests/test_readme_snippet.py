"""README's "Using the layer" snippet runs as written, in a fresh interpreter (it simulates its own 8 CPU devices),
and prints what its comments and the text after it say: the layer equals the reference, a small receive buffer
overflows and `apply_without_overflow` doubles it until nothing is lost."""

import pathlib
import re
import subprocess
import sys

import pytest

from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTION = "## Using the layer"
TOLERANCE = 1e-5


def snippet(readme: str) -> str:
  """The one ```python block of README's "Using the layer" section."""
  section = readme.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 1, f"{SECTION} holds {len(blocks)} python blocks"
  return blocks[0]


def test_snippet_is_extracted():
  code = snippet((ROOT / "README.md").read_text())
  assert code.startswith("import ") and "moejax.apply_without_overflow(" in code and "print(" in code


@pytest.mark.slow
def test_readme_snippet_runs_and_prints_what_it_says(tmp_path):
  result = subprocess.run(
    [sys.executable, "-c", snippet((ROOT / "README.md").read_text())],
    cwd=tmp_path,
    env=helpers.cpu_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  out = result.stdout
  counts = re.search(r"^aux_loss (\S+), token-choices per expert \[([\d, ]+)\]$", out, re.M)
  assert counts and sum(int(c) for c in counts.group(2).split(",")) == 512 * 2, out  # 512 tokens, top-2
  errors = [float(e) for e in re.findall(r"max \|y - y_ref\| (\S+)$", out, re.M)]
  assert len(errors) == 2 and all(e < TOLERANCE for e in errors), out  # worst-case, then grown buffers
  overflowed = re.search(r"^buffer_factor 0.5: (\d+) token-choices overflowed", out, re.M)
  assert overflowed and 0 < int(overflowed.group(1)) < 1024, out
  grown = re.search(r"^buffer_factor (\S+): 0 overflowed,", out, re.M)
  assert grown and float(grown.group(1)) in (1.0, 2.0, 4.0, 8.0), out  # 0.5 doubled


@pytest.mark.slow
def test_readme_models_snippet_runs_and_prints_what_it_says(tmp_path):
  """README's "Today's models" snippet, run where tests/ is at hand (its fixture path) and its export lands in
  tmp_path: the logits' error against transformers and the greedy tokens as the text after it says."""
  section = (ROOT / "README.md").read_text().split("\n## Today's models\n", 1)[1].split("\n## ", 1)[0]
  (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
  (tmp_path / "tests").symlink_to(ROOT / "tests")
  result = subprocess.run(
    [sys.executable, "-c", code], cwd=tmp_path, env=helpers.cpu_env(), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr
  error = re.search(r"^logits' relative error against transformers: (\S+)$", result.stdout, re.M)
  assert error and float(error.group(1)) < 1e-6, result.stdout
  assert "greedy tokens equal transformers': True" in result.stdout, result.stdout
  assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "exported" / "model.safetensors").is_file()
