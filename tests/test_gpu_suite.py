"""The GPU benchmark suite (benchmarks/gpu_suite.sh) end to end on CPU with --config.smoke=True: every step's JSON
exists, says 'ok' and holds finite positive timings; a failing step is recorded and the suite goes
on to the next one but exits non-zero. (~90 s on 2 CPU cores, the suite run once per session; its numbers mean nothing.)"""

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from moejax.data.tokenizer import cache_lock
from tests.helpers import ENV, ROOT

# slow: the GPU suite's smoke runs; one xdist worker runs the module, so no worker waits for the other's smoke run.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gpu_suite")]

SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
STEPS = (
  "env",
  "ceilings",
  "kernels",
  "layer",
  "chunking",
  "train_step",
  "attention",
  "decoder_step",
  "compile_time",
  "mixers",
)


def run_suite(out_dir, *options, steps=None, timeout=600, **variables):
  env = {**ENV, "PYTHON": sys.executable, "STEP_TIMEOUT": "0", "SUITE_TIMEOUT": "0", **variables}
  if steps is not None:
    env["STEPS"] = " ".join(steps)
  return subprocess.run(
    ["bash", str(SUITE), str(out_dir), *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )


def positive(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def timings(tree, path="") -> list[tuple[str, object]]:
  """Every (path, value) under a 'times_s' or 'median_s' key, at any depth."""
  found = []
  if isinstance(tree, dict):
    for key, value in tree.items():
      if key == "times_s":
        assert isinstance(value, list) and value, f"{path}.times_s is {value!r}"
        found += [(f"{path}.times_s[{i}]", v) for i, v in enumerate(value)]
      elif key == "median_s":
        found.append((f"{path}.median_s", value))
      else:
        found += timings(value, f"{path}.{key}")
  elif isinstance(tree, list):
    for i, value in enumerate(tree):
      found += timings(value, f"{path}[{i}]")
  return found


@pytest.fixture(scope="module")
def smoke(shared):
  """(OUT_DIR, the suite's exit status and output) of one --smoke run, shared by the xdist workers."""
  out = shared / "gpu_suite_smoke"
  result = shared / "gpu_suite_smoke.json"
  with cache_lock(str(shared / "locks" / "gpu_suite_smoke")):
    if not result.exists():
      shutil.rmtree(out, ignore_errors=True)
      done = run_suite(out, "--config.smoke=True")
      result.write_text(json.dumps({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}))
  return out, subprocess.CompletedProcess([], **json.loads(result.read_text()))


@pytest.fixture(scope="module")
def records(smoke):
  out, done = smoke
  assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
  result = {}
  for step in STEPS:
    path = out / f"{step}.json"
    assert path.exists(), f"{path} missing; suite output:\n{done.stdout[-3000:]}"
    result[step] = json.loads(path.read_text())
  return result


def test_suite_runs_every_step_and_logs_it(smoke, records):
  out, done = smoke
  summary = (out / "suite_summary.txt").read_text().split("\n")
  for step in STEPS:
    assert (out / f"{step}.log").stat().st_size > 0
    assert any(line.split()[:1] == [step] and line.endswith("ok") for line in summary), summary
  assert "all steps ok" in done.stdout


@pytest.mark.parametrize("step", STEPS)
def test_every_record_is_complete_with_finite_positive_timings(records, step):
  record = records[step]
  assert record["step"] == step
  assert record["status"] == "ok", record.get("error")
  assert record["smoke"] is True
  assert record["platform"] == "cpu" and record["device"]
  assert record["versions"]["jax"] and record["versions"]["jaxlib"] and record["versions"]["flax"]
  assert positive(record["wall_s"])
  found = timings(record)
  if step not in ("env", "compile_time"):  # compile_time: one compile per point (its own test checks the seconds)
    assert found, f"{step}.json has no timings"
  bad = [(path, value) for path, value in found if not positive(value)]
  assert not bad, bad


def test_env_names_the_machine(records):
  env = records["env"]
  assert env["devices"] and env["devices"][0]["platform"] == "cpu"
  assert env["nvidia_smi"]["available"] in (True, False)
  assert "jax" in env["environment_info"]
  assert set(env["optional_imports"]) == {"ml_collections", "tensorboardX", "tokamax", "qwix"}


def test_ceilings_give_rates(records):
  ceilings = records["ceilings"]
  assert [g["n"] for g in ceilings["gemm"]] == [256]
  assert positive(ceilings["gemm_tflops"]) and positive(ceilings["copy_gbps"])
  assert all(positive(g["tflops"]) and len(g["times_s"]) == 3 for g in ceilings["gemm"])
  assert {c["kind"] for c in ceilings["copy"]} >= {"copy", "scale"}


def test_kernels_cover_skews_passes_and_implementations(records):
  kernels = records["kernels"]
  assert kernels["interpret"] is True
  parts = [e for e in kernels["results"] if e["op"] == "parts"]
  results = [e for e in kernels["results"] if e["op"] != "parts"]
  cases = {(e["skew"], e["passes"], e["impl"]) for e in results}
  impls = (
    "pallas",
    "pallas_saved",
    "pallas_unfused",
    "ragged_dot",
    "tokamax",
    "fp8",
    "torch_grouped_mm",
    "dense_capacity",
    "dense_gemm",
  )
  assert cases == {(s, p, i) for s in ("balanced", "skewed") for p in ("fwd", "fwd_bwd") for i in impls}
  # Each kernel of the fused (gated) FFNs alone: 3 matmuls forward, 8 backward (2 of them the recompute), or 6 where
  # the pre-activations are kept.
  from moejax.bench.kernel_parts import FFN_PARTS

  for skew in ("balanced", "skewed"):
    mine = {e["part"]: e for e in parts if e["skew"] == skew}
    assert set(mine) == {p for names in FFN_PARTS.values() for p in names}
    assert all(positive(e["median_s"]) and positive(e["tflops"]) for e in mine.values())
    for ffn, backward in (("pallas", 8), ("pallas_saved", 6)):
      assert sum(mine[p]["matmuls"] for p in FFN_PARTS[ffn] if mine[p]["passes"] == "fwd") == 3
      assert sum(mine[p]["matmuls"] for p in FFN_PARTS[ffn] if mine[p]["passes"] == "bwd") == backward
  for e in results:
    assert "error" not in e, e
    if "skipped" in e:  # an optional package or device that is missing here, and only those
      assert e["impl"] in ("tokamax", "fp8", "torch_grouped_mm"), e
      assert "times_s" not in e and "median_s" not in e, e
      if e["impl"] in ("tokamax", "fp8"):
        package = "tokamax" if e["impl"] == "tokamax" else "qwix"
        assert package in e["skipped"] and importlib.util.find_spec(package) is None, e
      else:
        assert "torch" in e["skipped"] and ("CUDA" in e["skipped"] or importlib.util.find_spec("torch") is None), e
      continue
    assert positive(e["median_s"]) and positive(e["tflops"])
    if e["impl"] in ("pallas", "pallas_saved", "tokamax"):
      assert e["rel_err_vs_ragged_dot"] < 5e-2, e
    if e["impl"] == "fp8":  # two FP8 matmuls in a row (the gated FFN's first two share their input): a few percent
      assert 1e-3 < e["rel_err_vs_ragged_dot"] < 1.5e-1, e
  # On this CPU torch._grouped_mm never runs (CUDA only): skipped with the reason, in every case.
  assert all("skipped" in e for e in results if e["impl"] == "torch_grouped_mm")
  assert kernels["failed_cases"] == 0
  assert kernels["skipped_cases"] == sum("skipped" in e for e in results)


def test_kernels_write_the_backend_table(smoke, records):
  out, _ = smoke
  kernels = records["kernels"]
  assert kernels["backend_table"] == str(out.resolve() / "backend_table.json")
  table = json.loads((out / "backend_table.json").read_text())
  assert table["device"] == kernels["device"] and table["dtype"] == "bfloat16" and table["op"] == "ffn"
  assert table["candidates"] == ["pallas", "pallas_saved", "pallas_unfused", "ragged_dot", "tokamax"]
  ffn = [e for e in kernels["results"] if e["op"] == "ffn"]
  assert len(table["shapes"]) == len({(e["skew"], e["passes"]) for e in ffn}) == 4
  for row in table["shapes"]:
    assert row["model"] == "smoke_gated_e8" and row["rows"] == 64 and row["d"] == 32
    measured = {
      e["impl"]: e["median_s"]
      for e in ffn
      if (e["skew"], e["passes"]) == (row["skew"], row["passes"]) and "median_s" in e
    }
    assert row["candidates_median_s"] == {k: v for k, v in measured.items() if k in table["candidates"]}
    assert set(row["references_median_s"]) == {"dense_capacity", "dense_gemm", "fp8"}
    assert row["fastest"] == min(row["candidates_median_s"], key=row["candidates_median_s"].get)
    assert "torch_grouped_mm" in row["not_measured"]


def test_backend_table_picks_the_fastest_candidate_only():
  from moejax.bench.gpu import kernels_step as kernels

  class Rec:
    path = "/x/kernels.json"
    data = {"device": "dev", "platform": "gpu", "dtype": "bfloat16", "smoke": False, "versions": {}}

    def __getitem__(self, key):
      return self.data[key]

  shape = dict(model="m", d=8, f=16, experts=2, gated=True, activation="silu", rows=32, skew="balanced")
  results = [
    dict(shape, op="ffn", passes="fwd_bwd", impl=i, median_s=t)
    for i, t in (
      ("pallas", 3.0),
      ("pallas_unfused", 2.0),
      ("ragged_dot", 5.0),
      ("dense_gemm", 1.0),
      ("torch_grouped_mm", 1.5),
    )
  ]
  results += [
    dict(shape, op="ffn", passes="fwd_bwd", impl="tokamax", skipped="no tokamax"),
    dict(shape, op="gmm", passes="fwd_bwd", impl="ragged_dot", median_s=0.1),
  ]
  (row,) = kernels.backend_table(results, Rec())["shapes"]
  assert row["fastest"] == "pallas_unfused"  # dense_gemm and torch are references, never chosen
  assert row["references_median_s"] == {"dense_gemm": 1.0, "torch_grouped_mm": 1.5}
  assert row["not_measured"] == {"tokamax": "no tokamax", "pallas_saved": "not run"}


def test_layer_has_phases_mfu_and_the_collective_comparison(records):
  layer = records["layer"]
  assert positive(layer["gemm_tflops"]), layer["mfu_reference"]  # this run's ceilings
  measured = [c for c in layer["cases"] if "skipped" not in c]
  skipped = [c for c in layer["cases"] if "skipped" in c]
  assert {c["expert_backend"] for c in measured} == {"ragged_dot", "pallas"}
  assert all(c["collective"] == "padded" for c in measured)
  assert skipped and all(c["collective"] == "ragged" and "ragged all-to-all" in c["skipped"] for c in skipped)
  for c in measured:
    assert positive(c["phases_ms"]["layer_ms"]) and positive(c["phases_ms"]["layer_expert_ms"])
    for name in ("fwd", "fwd_bwd", "expert_phase"):
      assert positive(c[f"tflops_{name}"]) and positive(c[f"mfu_{name}"])
    assert c["expert_flops_fwd_bwd"] == 3 * c["expert_flops_fwd"] > 0
    assert sum(c["expert_counts"]) == c["rows"]
  assert layer["collective_comparison"] and all("skipped" in c for c in layer["collective_comparison"])


def test_train_step_reports_tokens_per_second(records):
  train = records["train_step"]
  assert train["collective"] == "padded"
  (run,) = train["runs"]
  assert positive(run["tokens_per_s"]) and positive(run["parameters"])
  assert math.isclose(run["tokens_per_s"], train["tokens_per_step"] / run["median_s"])
  assert all(math.isfinite(v) for v in run["losses"])


def test_a_failing_step_is_recorded_and_the_suite_goes_on(tmp_path):
  done = run_suite(tmp_path, "--config.smoke=True", "--config.layer_backends=no_such_backend", steps=("layer", "env"))
  assert done.returncode != 0
  layer = json.loads((tmp_path / "layer.json").read_text())
  assert layer["status"] == "error" and "no_such_backend" in layer["error"]
  assert json.loads((tmp_path / "env.json").read_text())["status"] == "ok"  # ran after the failure
  summary = (tmp_path / "suite_summary.txt").read_text()
  assert "layer" in summary and "failed rc=1" in summary
  assert "failed steps: layer" in done.stdout


def test_a_step_past_its_time_limit_is_killed_and_later_steps_are_not_started(tmp_path):
  # A stand-in for Python that never ends, so the outcome does not hang on how fast this machine runs a real step:
  # it gets 3 s (STEP_TIMEOUT) and ends by the TERM signal (rc 124); then 32 - 3 - 20 (kept for the kill and the
  # summary) = 9 s are left, under the 10 a step needs to start, so env is not started.
  never_ends = tmp_path / "never_ends"
  never_ends.write_text("#!/bin/sh\nexec sleep 60\n")
  never_ends.chmod(0o755)
  out = tmp_path / "out"
  done = run_suite(
    out, "--config.smoke=True", steps=("kernels", "env"), STEP_TIMEOUT="3", SUITE_TIMEOUT="32", PYTHON=str(never_ends)
  )
  assert done.returncode != 0
  summary = (out / "suite_summary.txt").read_text()
  assert re.search(r"^kernels .* failed rc=124 \(timed out after 3s\)$", summary, re.M), summary
  assert re.search(r"^env .* not started \(SUITE_TIMEOUT\)$", summary, re.M), summary
  assert "failed steps: kernels env" in done.stdout


def test_a_terminated_step_keeps_what_it_measured_and_says_why_it_stopped(tmp_path, monkeypatch):
  """SIGTERM (what the suite's `timeout` sends) in the middle of a step: run_step returns 1 and the record keeps the
  step's partial results, with status 'terminated' and the traceback."""
  from configs import gpu_suite as suite_config
  from experiments import gpu_suite

  def step_killed_halfway(args, rec):
    del args
    rec["measured_so_far"] = [1.5]
    rec.save()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the handler raises here, in the main thread
    raise AssertionError("SIGTERM did not stop the step")

  monkeypatch.setitem(gpu_suite.STEP_FUNCTIONS, "env", step_killed_halfway)
  previous = signal.getsignal(signal.SIGTERM)
  try:
    config = suite_config.get_config()
    config.update(step="env", smoke=True)
    assert gpu_suite.run_step(config, str(tmp_path)) == 1
  finally:
    signal.signal(signal.SIGTERM, previous)
  record = json.loads((tmp_path / "env.json").read_text())
  assert record["status"] == "terminated" and record["measured_so_far"] == [1.5]
  assert "Terminated: signal 15" in record["error"]


def test_bad_usage_is_rejected(tmp_path):
  done = run_suite(tmp_path / "x", steps=("env",))
  assert done.returncode == 0  # a missing OUT_DIR is created
  assert os.path.exists(tmp_path / "x" / "env.json")
  assert run_suite("--config.smoke=True").returncode == 2


def test_chunking_times_every_piece_count_and_schedule(records):
  record = records["chunking"]
  chunks = record["chunks"]
  for gemm in ("first_gemm", "second_gemm"):
    cases = [c for c in record["gemms"] if c["gemm"] == gemm]
    assert [c["pieces"] for c in cases] == chunks
    assert cases[0]["time_vs_one_call"] == 1.0 and all(positive(c["tflops"]) for c in cases)
  assert {c["schedule"] for c in record["schedules"]} == {"sequential", "chunked", "comet"}
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in record["xla_flags"]


def test_layer_models_include_the_published_presets():
  """The suite's layer step times DeepSeek-V3's and Qwen3-MoE's routed layers from `moejax.models.presets`."""
  from moejax.bench.gpu import shapes
  from moejax.models import presets
  from moejax.moe.config import MoEConfig

  for name in ("deepseek_v3", "qwen3_moe"):
    shape = dict(shapes.LAYER_MODELS[name])
    tokens = shape.pop("tokens")
    cfg = MoEConfig(**shape)
    published = presets.PRESETS[name].moe
    for field in ("d_model", "d_ff", "top_k", "score", "num_groups", "num_shared_experts", "routed_scaling"):
      assert getattr(cfg, field) == published.get(field, getattr(MoEConfig, field, None)), (name, field)
    assert tokens * cfg.top_k == shapes.ROWS


def test_attention_times_each_implementation_against_the_materialised_one(records):
  """Each smoke model's attention: 'materialized' and 'xla' measured (positive times, temporary bytes, the visible
  pairs' FLOPs), XLA's output and gradients close to the materialised ones in bf16; cuDNN and tokamax skipped with the
  reason on this CPU; over a KV cache, 'xla' measured and the others skipped alike."""
  from moejax.bench.gpu.shapes import SMOKE_ATTENTION_MODELS, SMOKE_ATTENTION_SEQ_LEN

  record = records["attention"]
  assert record["dtype"] == "bfloat16" and record["seq_len"] == SMOKE_ATTENTION_SEQ_LEN and record["failed_cases"] == 0
  s = SMOKE_ATTENTION_SEQ_LEN
  for name, shape in SMOKE_ATTENTION_MODELS.items():
    cases = {c["impl"]: c for c in record["cases"] if c["model"] == name}
    assert set(cases) == {"materialized", "xla", "cudnn", "cudnn_unpadded", "tokamax"}
    for impl in ("materialized", "xla"):
      case = cases[impl]
      visible_pairs = int(np.tril(np.ones((s, s))).sum())
      assert case["flops_fwd"] == 2 * shape["heads"] * visible_pairs * (shape["width"] + shape["v_width"])
      assert case["flops_fwd_bwd"] == 3 * case["flops_fwd"]
      assert positive(case["tflops_fwd"]) and positive(case["tflops_fwd_bwd"]) and positive(case["temp_bytes_fwd_bwd"])
    errors = cases["xla"]["rel_err_vs_materialized"]
    assert set(errors) == {"out", "dq", "dk", "dv"} and all(0 <= e < 2e-2 for e in errors.values()), errors
    assert "cpu device" in cases["cudnn"]["skipped"] and "attention_impl" in cases["cudnn"]["skipped"]
    assert ("cpu device" if shape["width"] != shape["v_width"] else "equally wide") in cases["cudnn_unpadded"][
      "skipped"
    ]
    if importlib.util.find_spec("tokamax") is None:
      assert "tokamax installed" in cases["tokamax"]["skipped"]
    decode = {c["impl"]: c for c in record["decode"] if c["model"] == name}
    assert set(decode) == {"xla", "cudnn", "tokamax"} and positive(decode["xla"]["step"]["median_s"])
    assert decode["xla"]["prefill"] == s // 2 and "cpu device" in decode["cudnn"]["skipped"]


def test_mixers_time_each_implementation_against_the_recurrent_rule(records):
  """The smoke gated DeltaNet: the chunked rule and the layer measured (positive times, temporary bytes, the chunked
  form's FLOPs), each close to the recurrent rule (the layer: to itself decoding) on the checked prefix; tokamax
  skipped with the reason where it is not installed."""
  from moejax.bench.gpu import mixers
  from moejax.bench.gpu.shapes import SMOKE_MIXER_CHUNKS, SMOKE_MIXER_MODELS, SMOKE_MIXER_SEQ_LENS
  from moejax.models.mixers.gated_deltanet import GatedDeltaNetConfig

  record = records["mixers"]
  assert record["failed_cases"] == 0 and record["dtype"] == "bfloat16"
  cfg = GatedDeltaNetConfig.from_hf(SMOKE_MIXER_MODELS["smoke_gdn"])
  cases = {(c["impl"], c["chunk"], c["seq_len"]): c for c in record["cases"]}
  (s,) = SMOKE_MIXER_SEQ_LENS
  want = {("chunked", c, s) for c in SMOKE_MIXER_CHUNKS} | {("tokamax", 64, s), ("layer", cfg.chunk, s)}
  assert set(cases) == want
  for key in want - {("tokamax", 64, s)}:
    case = cases[key]
    assert all(positive(case[f]) for f in ("tflops_fwd", "tflops_fwd_bwd", "temp_bytes_fwd_bwd")), case
    assert case["flops_fwd_bwd"] == 3 * case["flops_fwd"]
    assert all(0 <= d < 1e-5 for d in case["max_rel_diff"].values()), case["max_rel_diff"]
  chunk = SMOKE_MIXER_CHUNKS[0]
  k, v, h = cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads
  assert cases[("chunked", chunk, s)]["flops_fwd"] == s * h * (chunk * (5 * k + 3 * v) + 6 * k * v)
  assert set(cases[("chunked", chunk, s)]["max_rel_diff"]) == {"out", "dq", "dk", "dv", "dg", "dbeta"}
  assert cases[("layer", cfg.chunk, s)]["flops_fwd"] == mixers.layer_flops(cfg, s) > mixers.rule_flops(cfg, s, 64)
  if importlib.util.find_spec("tokamax") is None:
    assert cases[("tokamax", 64, s)]["skipped"] == "tokamax not installed"


def test_gpu_parts_name_known_shapes_and_steps(tmp_path):
  """benchmarks/gpu_parts.sh: every model, implementation, step and config field it names exists (a typo would waste GPU
  time), every kernel and layer model is in some part, every implementation timed at every kernel model, and parts
  3, 4 and 8 refuse to start without part 1's ceiling."""
  from configs import gpu_suite as suite_config
  from configs import tune_kernels as tune_config
  from experiments.gpu_suite import STEPS
  from moejax.bench.gpu.shapes import ATTENTION_MODELS, KERNEL_MODELS, LAYER_MODELS
  from moejax.bench.kernel_impls import IMPLS

  script = (ROOT / "benchmarks" / "gpu_parts.sh").read_text()
  named = lambda field: {m for group in re.findall(rf"--config\.{field}=([\w.,]+)", script) for m in group.split(",")}
  assert named("kernel_models") == set(KERNEL_MODELS) and named("layer_models") == set(LAYER_MODELS)
  assert named("attention_models") == set(ATTENTION_MODELS)
  impl_lists = dict(re.findall(r"^(\w+)=([\w,]+)  #", script, re.M))  # OURS=..., LIBRARIES=...
  kernel_parts = re.findall(r"--config\.kernel_models=([\w.,]+)[ \\\n]*--config\.kernel_impls=\$(\w+)", script)
  timed = {(m, i) for models, impls in kernel_parts for m in models.split(",") for i in impl_lists[impls].split(",")}
  assert timed == {(m, i) for m in KERNEL_MODELS for i in IMPLS}
  start = script.index("-m experiments.tune_kernels")
  end = script.index(";;", start)
  part5 = script[start:end]
  suite_parts = script[script.index("case $part in") : start] + script[end:]  # parts 1-4 and 6
  suite_fields = set(re.findall(r"--config\.(\w+)=", suite_parts))
  assert suite_fields and suite_fields <= set(suite_config.get_config())
  steps = {s for group in re.findall(r'STEPS="([\w ]+)"', script) for s in group.split()}
  assert steps == set(STEPS)
  # Part 5's fields are tune_kernels' own.
  assert set(re.findall(r"--config\.(\w+)=", part5)) <= set(tune_config.get_config()) and "tgmm" in part5
  for part in ("3", "4", "8", "10"):
    run = subprocess.run(
      ["bash", str(ROOT / "benchmarks" / "gpu_parts.sh"), str(tmp_path), part],
      capture_output=True,
      text=True,
      env=ENV,
      timeout=60,
    )
    assert run.returncode == 2 and ("part1/ceilings.json" in run.stderr or "PART must be" in run.stderr), run.stderr


def test_decoder_step_reports_tokens_per_second_and_mfu(records):
  """The smoke decoder: the one layer of 8 experts that fits the smoke budget by the analytic count, timed; its
  parameter count (what the MFU's FLOPs come from) is the state's, and tokens/s and MFU follow from the timings."""
  from moejax.bench.gpu import decoder_step

  record = records["decoder_step"]
  (case,) = record["cases"]
  assert (case["expert_backend"], case["experts"], case["layers"], case["layers_fitted"]) == ("ragged_dot", 8, 1, 1)
  assert "out_of_memory" not in case
  assert case["analytic_bytes"]["total"] <= record["budget_bytes"] == decoder_step.SMOKE_BUDGET
  assert case["total"] == case["parameters_in_state"]
  assert case["tokens"] == record["batch"] * record["seq_len"]
  assert math.isclose(case["tokens_per_s"], case["tokens"] / case["median_s"])
  assert math.isclose(case["mfu"], case["flops"] / case["median_s"] / 1e12 / record["gemm_tflops"])
  assert all(math.isfinite(v) for v in case["losses"]) and len(case["losses"]) == 1 + 1 + 3


def test_decoder_layers_fit_the_budget():
  """fit_layers: the most layers whose analytic count fits, none where one layer does not."""
  from moejax.bench.gpu import decoder_step as ds

  make = lambda layers: ds.decoder_config(layers, 8, "ragged_dot", "full", True, "float32")
  totals = [ds.analytic_bytes(make(layers))["total"] for layers in (1, 2, 3)]
  assert totals[0] < totals[1] < totals[2]
  assert ds.fit_layers(make, totals[1], 4)[0] == 2
  assert ds.fit_layers(make, totals[1] - 1, 4) == (1, ds.analytic_bytes(make(1)))
  assert ds.fit_layers(make, totals[0] - 1, 4) == (0, None)
  assert ds.fit_layers(make, totals[2], 2)[0] == 2  # never past max_layers


def test_decoder_model_flops_count_the_parameters_a_token_meets():
  """parameter_counts against the model's own parameter tree (Qwen3-MoE's published widths, 2 layers of 128 experts,
  abstract: nothing allocated): every tensor for the total; for the active count the matrices without the embedding
  and the norms, each expert tensor at top_k / experts. Attention: 4 x heads x head width FLOPs per visible pair."""
  import jax

  from moejax.bench.gpu import decoder_step as ds
  from moejax.models import state as state_lib
  from moejax.runtime import mesh as mesh_lib
  from moejax.study import memory
  from moejax.train import config as config_lib

  config = ds.decoder_config(2, 128, "ragged_dot", "full", False, "bfloat16")
  model_cfg, moe_cfg = config_lib.validate(config)
  _, params, _ = state_lib.abstract_state(model_cfg, moe_cfg, mesh_lib.make_mesh(1, 1), 0)
  total = active = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)
    size = int(np.prod(leaf.shape))
    total += size
    if "embed" in name or "norm" in name or "ln_" in name:
      continue
    expert = any(f"'{w}'" in name for w in ("w_in", "w_gate", "w_out"))
    active += size * moe_cfg.top_k // moe_cfg.num_experts if expert else size
  counts = ds.parameter_counts(model_cfg, moe_cfg)
  assert counts["total"] == total == memory.analytic_state(model_cfg, moe_cfg, 1, 1)["parameter_count"]
  assert counts["active"] == active
  flops = ds.model_flops(model_cfg, moe_cfg, batch=2, seq_len=8)
  pairs = sum(range(1, 9))
  assert flops["attention_flops"] == 3 * 2 * 2 * pairs * 4 * model_cfg.num_heads * model_cfg.head_dim
  assert flops["flops"] == 6 * active * 16 + flops["attention_flops"]


def test_compile_time_measures_the_scanned_and_the_unrolled_step(records):
  """The smoke compile_time: tiny Qwen3-MoE at 2 layers on the 1 x 1 mesh, its warm-up kept apart, then scanned and
  unrolled (config.compile_scan's order), each with positive wall and CPU seconds that add up, and the ratios row."""
  from moejax.bench.gpu import compile_time

  record = records["compile_time"]
  assert record["mesh"] == "1x1" and record["device_count"] == 1
  assert (record["families"], record["layers"]) == (list(compile_time.SMOKE_FAMILIES), list(compile_time.SMOKE_LAYERS))
  assert [(p["family"], p["layers"], p["scan_layers"]) for p in record["warmups"]] == [("qwen3_moe", 2, True)]
  assert [(p["family"], p["layers"], p["scan_layers"]) for p in record["points"]] == [
    ("qwen3_moe", 2, True),
    ("qwen3_moe", 2, False),
  ]
  for point in record["warmups"] + record["points"]:
    for kind in ("", "_cpu"):
      parts = [point[f"{name}{kind}_s"] for name in ("trace_lower", "compile", "total")]
      assert all(positive(v) for v in parts) and math.isclose(parts[0] + parts[1], parts[2]), point
    assert isinstance(point["program_lines"], int) and point["program_lines"] > 0
  (row,) = record["ratios"]
  scanned, unrolled = (p["total_s"] for p in record["points"])
  assert (row["scanned_s"], row["unrolled_s"]) == (scanned, unrolled)
  assert math.isclose(row["scanned_over_unrolled"], scanned / unrolled)
  assert row["scanned_vs_2_layers"] == row["unrolled_vs_2_layers"] == 1.0


def test_compile_time_ratios_and_table_compare_each_depth_to_the_shallowest():
  """ratios and table on made-up points: each depth against the family's shallowest of its kind, scanned against
  unrolled; a point that is missing (a step stopped part-way) leaves None and a blank cell."""
  from moejax.bench.gpu import compile_time

  point = lambda layers, scan, s: dict(
    family="qwen3_moe",
    layers=layers,
    scan_layers=scan,
    total_s=s,
    total_cpu_s=2 * s,
    program_lines=100 if scan else layers * 10,
  )
  points = [point(8, True, 4.0), point(32, True, 5.0), point(8, False, 2.0)]
  assert compile_time.ratios(points) == [
    dict(
      family="qwen3_moe",
      layers=8,
      scanned_s=4.0,
      scanned_vs_8_layers=1.0,
      unrolled_s=2.0,
      unrolled_vs_8_layers=1.0,
      scanned_over_unrolled=2.0,
    ),
    dict(
      family="qwen3_moe",
      layers=32,
      scanned_s=5.0,
      scanned_vs_8_layers=1.25,
      unrolled_s=None,
      unrolled_vs_8_layers=None,
      scanned_over_unrolled=None,
    ),
  ]
  lines = compile_time.table(points + [point(32, False, 8.0)], "total_s", "s").splitlines()
  assert lines[2].split() == ["qwen3_moe", "32", "8.0", "4.00x", "5.0", "1.25x", "320", "100"]
  assert compile_time.table(points).splitlines()[2].split() == ["qwen3_moe", "32", "10.0", "1.25x", "100"]


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("compile_families", ("qwen3_moe", "nope"), "a non-empty tuple of ["),
    ("compile_layers", (8, 1), "ints >= 2"),
    ("compile_scan", (), "True / False"),
  ],
)
def test_compile_time_fields_are_checked_before_the_step_starts(field, value, message):
  """A bad compile_* field is refused by resolved() (one error line naming it), in a smoke run too."""
  from configs import gpu_suite as suite_config
  from experiments import gpu_suite
  from moejax.validation import ConfigError

  config = suite_config.get_config()
  config.update(step="compile_time", smoke=True, **{field: value})
  with pytest.raises(ConfigError, match=rf"^config field {field}=.* is not allowed: .*{re.escape(message)}"):
    gpu_suite.resolved(config)
  config.update(step="env")
  gpu_suite.resolved(config)  # only the compile_time step reads them


def test_gpu_run_names_known_shapes_steps_and_fields():
  """benchmarks/gpu_run.sh: every model, implementation, step and config field it names exists (a typo would waste a
  rare GPU lease), and every kernel model is timed through every implementation."""
  from configs import gpu_suite as suite_config
  from experiments.gpu_suite import STEPS as SUITE_STEPS
  from moejax.bench.gpu.attention import IMPLS as ATTENTION_IMPLS
  from moejax.bench.gpu.shapes import ATTENTION_MODELS, KERNEL_MODELS, LAYER_MODELS, MIXER_MODELS
  from moejax.bench.kernel_impls import IMPLS

  script = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
  ffn_impls = re.search(r"^FFN_IMPLS=([\w,]+)$", script, re.M).group(1).split(",")
  script = script.replace("$FFN_IMPLS", ",".join(ffn_impls))
  named = lambda field: {m for group in re.findall(rf"--config\.{field}=([\w.,]+)", script) for m in group.split(",")}
  assert named("kernel_models") == set(KERNEL_MODELS) and set(ffn_impls) == set(IMPLS)
  assert named("layer_models") <= set(LAYER_MODELS) and named("attention_models") == set(ATTENTION_MODELS)
  assert named("attention_impls") <= set(ATTENTION_IMPLS) and named("mixer_models") <= set(MIXER_MODELS)
  assert set(re.findall(r"--config\.(\w+)=", script)) - {"FIELD"} <= set(suite_config.get_config())  # FIELD: usage
  entries = re.findall(r'^entry (\w+) (\d+) "?([\w ]+?)"? ', script, re.M)
  assert {s for _, _, steps in entries for s in steps.split()} <= set(SUITE_STEPS) and len(entries) >= 7


def test_gpu_run_keeps_to_its_budget_and_resumes(tmp_path):
  """A budget that fits only the first entries runs those and marks them done; the same command again skips them and
  goes on with the first left undone (one the budget stopped, or the first not started; smoke: tiny shapes on CPU)."""
  env = {**ENV, "PYTHON": sys.executable}
  cmd = ["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), str(tmp_path), "45", "--config.smoke=True"]
  first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
  assert (tmp_path / "core" / "done").exists()
  assert json.loads((tmp_path / "core" / "ceilings.json").read_text())["status"] == "ok"
  not_started = re.findall(r"(\w+): not started", first.stdout)
  assert not_started, first.stdout  # the budget ran out before the last entries
  # the first entry left without its done mark: one the budget stopped, else the first not started
  order = re.findall(r"^\[gpu_run [\d:]+\] (\w+): (?:start|not started)", first.stdout, re.M)
  undone = next(entry for entry in order if not (tmp_path / entry / "done").exists())
  stamp = (tmp_path / "core" / "ceilings.json").stat().st_mtime
  second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert "core: done earlier, skipped" in second.stdout, second.stdout
  assert (tmp_path / "core" / "ceilings.json").stat().st_mtime == stamp
  assert f"{undone}: start" in second.stdout, second.stdout
  bad = subprocess.run(["bash", cmd[1], str(tmp_path), "ten"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert bad.returncode == 2 and "BUDGET_S must be whole seconds; got 'ten'" in bad.stderr


FAKE_TOKAMAX_OPS = '''
import jax
import jax.numpy as jnp


def kimi_delta_attention(query, key, value, gate, beta, *, a_log, use_gate_in_kernel, lower_bound, implementation):
  """Kimi delta attention as tokamax's reference defines it (heads first [H, B, T, ...], a decay per key channel,
  the gate activated as lower_bound * sigmoid(exp(a_log) gate)), token by token."""
  assert use_gate_in_kernel and implementation == "xla_chunked"
  g = lower_bound * jax.nn.sigmoid(jnp.exp(a_log)[:, None, None, None] * gate)
  q = query.astype(jnp.float32) * query.shape[-1] ** -0.5
  k, v = key.astype(jnp.float32), value.astype(jnp.float32)

  def step(state, xs):  # state [H, B, K, V]
    q_t, k_t, v_t, g_t, b_t = xs
    state = state * jnp.exp(g_t)[..., None]
    residual = v_t - jnp.einsum("hbk,hbkv->hbv", k_t, state)
    state = state + (b_t[..., None] * k_t)[..., None] * residual[..., None, :]
    return state, jnp.einsum("hbk,hbkv->hbv", q_t, state)

  state = jnp.zeros((*q.shape[:2], q.shape[-1], v.shape[-1]), jnp.float32)
  _, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta)))
  return jnp.moveaxis(o, 0, 2).astype(value.dtype), None
'''


def test_mixers_tokamax_adapter_is_the_gated_delta_rule(tmp_path, monkeypatch):
  """The tokamax case's arguments (heads first, key heads repeated, the decay as Kimi delta attention's activated
  gate, the same for every key channel) give moejax's rule: against a stand-in `tokamax.ops` that computes Kimi delta
  attention as tokamax's reference defines it (tokamax itself needs Python 3.12 and jax 0.11 here)."""
  from moejax.bench.gpu import mixers
  from moejax.bench.gpu.shapes import SMOKE_MIXER_MODELS
  from moejax.models.mixers.gated_deltanet import GatedDeltaNetConfig

  (tmp_path / "tokamax").mkdir()
  (tmp_path / "tokamax" / "__init__.py").write_text("")
  (tmp_path / "tokamax" / "ops.py").write_text(FAKE_TOKAMAX_OPS)
  monkeypatch.syspath_prepend(str(tmp_path))
  for name in ("tokamax", "tokamax.ops"):
    monkeypatch.delitem(sys.modules, name, raising=False)
  cfg = GatedDeltaNetConfig.from_hf(SMOKE_MIXER_MODELS["smoke_gdn"])
  diffs = mixers.check("tokamax", cfg, 64, 24, {})
  assert set(diffs) == {"out", "dq", "dk", "dv", "dg", "dbeta"} and all(d < 1e-5 for d in diffs.values()), diffs
