"""experiments/gpu_tables: the GPU suite's records as tables and targets, on records written here with known numbers
(the targets' ratios recomputed from them), the later of two records counting, smoke records and other devices
refused."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.bench.gpu import tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, step, started, device="GPU X", **fields):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(step=step, status="ok", smoke=False, device=device, started_utc=started, **fields), f)


def _ffn(model, passes, impl, seconds, flops=1e12):
  return dict(
    model=model,
    rows=16384,
    skew="balanced",
    op="ffn",
    passes=passes,
    impl=impl,
    median_s=seconds,
    tflops=flops / seconds / 1e12,
  )


@pytest.fixture
def results_dir(tmp_path):
  rng = np.random.default_rng()
  t = {k: float(v) for k, v in zip(("pallas", "capacity", "fp8", "old"), rng.uniform(0.01, 0.05, 4))}
  _write(str(tmp_path / "core" / "ceilings.json"), "ceilings", "2026-01-01T00:00:00", gemm_tflops=500.0)
  _write(
    str(tmp_path / "a" / "kernels.json"),
    "kernels",
    "2026-01-01T00:01:00",
    results=[
      _ffn("mixtral_8x7b", "fwd_bwd", "pallas", t["old"]),
      _ffn("mixtral_8x7b", "fwd_bwd", "dense_capacity", t["capacity"]),
      dict(model="mixtral_8x7b", rows=16384, skew="balanced", op="ffn", passes="fwd_bwd", impl="tokamax", error="boom"),
    ],
  )
  _write(
    str(tmp_path / "b" / "kernels.json"),
    "kernels",
    "2026-01-01T00:02:00",
    results=[
      _ffn("mixtral_8x7b", "fwd_bwd", "pallas", t["pallas"]),
      _ffn("mixtral_8x7b", "fwd_bwd", "fp8", t["fp8"]),
    ],
  )
  phases = dict(layer_ms=10.0, layer_expert_ms=float(rng.uniform(5, 10)))
  _write(
    str(tmp_path / "c" / "layer.json"),
    "layer",
    "2026-01-01T00:03:00",
    cases=[
      dict(
        model="mixtral_8x7b",
        collective="ragged",
        expert_backend="pallas",
        fwd=dict(median_s=0.01),
        fwd_bwd=dict(median_s=0.04),
        tflops_fwd=400.0,
        tflops_fwd_bwd=260.0,
        phases_ms=phases,
      ),
    ],
  )
  os.makedirs(tmp_path / "smoke")
  with open(tmp_path / "smoke" / "layer.json", "w") as f:
    json.dump(dict(step="layer", smoke=True, device="cpu", cases=[]), f)
  return tmp_path, t, phases


def test_targets_are_the_ratios_of_the_latest_records(results_dir):
  root, t, phases = results_dir
  res = tables.load(str(root))
  assert res.ceiling == 500.0 and res.device == "GPU X"
  got = {name: (value, met) for name, _, value, met in tables.targets(res)}
  value, met = got["mixtral_8x7b FFN fwd+bwd: pallas at least as fast as dense_capacity"]
  assert value == pytest.approx(t["capacity"] / t["pallas"]) and met == (t["capacity"] >= t["pallas"])
  value, met = got["mixtral_8x7b FFN fwd+bwd: FP8 at least 1.5x bf16 (pallas)"]
  assert value == pytest.approx(t["pallas"] / t["fp8"]) and met == (t["pallas"] / t["fp8"] >= 1.5)
  assert got["mixtral_8x7b FFN fwd+bwd: pallas at least as fast as tokamax"] == (None, None)  # its case raised
  value, met = got["mixtral_8x7b layer (ragged, pallas): non-expert share of the forward at most 25%"]
  share = 1 - phases["layer_expert_ms"] / phases["layer_ms"]
  assert value == pytest.approx(share) and met == (share <= 0.25)
  assert got["mixtral_8x7b layer (ragged, pallas): MFU fwd+bwd at least 0.55"] == (pytest.approx(260 / 500), False)


def test_markdown_shows_each_case_once_with_errors_named(results_dir):
  root, t, _ = results_dir
  text = tables.markdown(tables.load(str(root)))
  row = next(line for line in text.splitlines() if line.startswith("| mixtral_8x7b | balanced | fwd_bwd"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  header = next(line for line in text.splitlines() if line.startswith("| model | groups"))
  columns = [c.strip() for c in header.strip("|").split("|")]
  assert cells[columns.index("pallas")] == f"{t['pallas'] * 1e3:.1f} ({1 / t['pallas']:.0f})"
  assert cells[columns.index("tokamax")] == "error"
  assert "cpu" not in text  # the smoke record is not read


def test_refuses_an_empty_directory_and_mixed_devices(tmp_path):
  with pytest.raises(tables.NoRecords, match="no GPU suite records"):
    tables.load(str(tmp_path))
  _write(str(tmp_path / "a" / "ceilings.json"), "ceilings", "1", device="GPU X", gemm_tflops=1.0)
  _write(str(tmp_path / "b" / "ceilings.json"), "ceilings", "2", device="GPU Y", gemm_tflops=1.0)
  with pytest.raises(tables.NoRecords, match="several devices"):
    tables.load(str(tmp_path))


def test_the_program_prints_the_committed_h200_tables():
  out = subprocess.run(
    [sys.executable, "-m", "experiments.gpu_tables", os.path.join(ROOT, "benchmarks", "results", "2026-11-28-h200")],
    capture_output=True,
    text=True,
    check=True,
    cwd=ROOT,
  ).stdout
  assert "Device: NVIDIA H200" in out and "| Targets" not in out and "\nTargets\n" in out
