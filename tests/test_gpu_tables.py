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


def _mixer_case(impl, chunk, seq_len, fwd_s, fwd_bwd_s, flops=2e12, diffs=None):
  return dict(
    model="qwen3_next_80b_a3b",
    impl=impl,
    chunk=chunk,
    seq_len=seq_len,
    fwd=dict(median_s=fwd_s),
    fwd_bwd=dict(median_s=fwd_bwd_s),
    tflops_fwd=flops / fwd_s / 1e12,
    tflops_fwd_bwd=3 * flops / fwd_bwd_s / 1e12,
    max_rel_diff=diffs or {"out": 1e-6},
  )


def test_mixers_table_gives_ms_rates_and_differences_per_implementation_length_and_pass(tmp_path):
  """The mixers table: one row per implementation, chunk, length and pass with the median ms, TFLOP/s and the prefix
  check's difference (fwd+bwd: the largest gradient's), a later record replacing a case, a skipped case with its
  reason, and the mixers records alone enough for the tables."""
  diffs = {"out": 2e-6, "dq": 3e-6, "dk": 5e-5, "dv": 1e-6, "dg": 4e-6, "dbeta": 2e-6}
  _write(
    str(tmp_path / "a" / "mixers.json"),
    "mixers",
    "2026-01-01T00:00:00",
    cases=[_mixer_case("chunked", 64, 4096, 0.5, 1.0)],
  )
  skipped = dict(model="qwen3_next_80b_a3b", impl="tokamax", chunk=64, seq_len=4096, skipped="tokamax not installed")
  _write(
    str(tmp_path / "b" / "mixers.json"),
    "mixers",
    "2026-01-01T00:01:00",
    cases=[
      _mixer_case("chunked", 64, 4096, 0.004, 0.010, diffs=diffs),
      _mixer_case("layer", 64, 16384, 0.020, 0.050, flops=4e12, diffs={"out": 7e-7}),
      skipped,
    ],
  )
  res = tables.load(str(tmp_path))
  assert set(res.mixers) == {("qwen3_next_80b_a3b", i, 64, s) for i, s in (("chunked", 4096), ("layer", 16384))} | {
    ("qwen3_next_80b_a3b", "tokamax", 64, 4096)
  }
  lines = tables.mixers_table(res)
  assert lines[0] == "| model | impl | chunk | tokens | pass | ms | TFLOP/s | max rel diff |"
  rows = {tuple(c.strip() for c in line.strip("|").split("|"))[1:5]: line for line in lines[2:]}
  cells = lambda key: [c.strip() for c in rows[key].strip("|").split("|")][5:]
  assert cells(("chunked", "64", "4096", "fwd")) == ["4", f"{2e12 / 0.004 / 1e12:.3g}", "2.0e-06"]
  assert cells(("chunked", "64", "4096", "fwd+bwd")) == ["10.0", f"{6e12 / 0.010 / 1e12:.3g}", "5.0e-05"]
  assert cells(("layer", "64", "16384", "fwd")) == ["20.0", "200", "7.0e-07"]
  assert cells(("layer", "64", "16384", "fwd+bwd")) == ["50.0", "240", "-"]  # the layer checks its output only
  assert cells(("tokamax", "64", "4096", ""))[0] == "tokamax not installed"
  assert len(lines) == 2 + 5
  text = tables.markdown(res)
  assert "Gated DeltaNet (Qwen3-Next)" in text and "\nTargets\n" in text
