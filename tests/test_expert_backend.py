"""expert_backend='auto' (moejax.cost.expert_backend): a measured table's fastest backend at the layer's per-device
shape, refused where nothing was measured; and 'pallas_unfused' and 'pallas_saved', backends it chooses among."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import expert_table
from moejax.bench import kernel_cases, kernels
from moejax.cost import expert_backend as eb
from moejax.moe import experts
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT, assert_matches_reference, normal, random_params
from tests.numpy_moe import ACT

H100_RECORDS = ROOT / "benchmarks" / "results" / "2026-11-23-h100"
BASE = dict(num_experts=16, top_k=2, d_model=16, d_ff=32, gated=True, activation="silu")


def _row(d, f, experts, rows, passes, times, gated=True, activation="silu", skew="balanced"):
  """A bench_kernels result list for one shape: `times` {impl: median seconds, or None for skipped}."""
  shape = dict(
    model="m",
    d=d,
    f=f,
    experts=experts,
    gated=gated,
    activation=activation,
    rows=rows,
    skew=skew,
    passes=passes,
    op="ffn",
  )
  return [
    dict(shape, impl=i, median_s=t) if t is not None else dict(shape, impl=i, skipped="absent")
    for i, t in times.items()
  ]


def _write_table(tmp_path, results, device="cpu", dtype="float32") -> str:
  table = eb.table_from_results(
    results, dict(device=device, platform="cpu", dtype=dtype, smoke=False, versions={}, source="test")
  )
  path = tmp_path / "table.json"
  path.write_text(json.dumps(table))
  return str(path)


# ---------------------------------------------------------------------------------------------------------------
# pallas_unfused: a gmm per matmul, the hidden activations kept


@pytest.mark.parametrize("gated,activation", [(True, "silu"), (False, "gelu")])
def test_unfused_pallas_ffn_and_grads_match_numpy(gated, activation):
  rng = np.random.default_rng(3)
  sizes = np.array([5, 0, 9, 2], np.int32)  # an empty group, and 4 rows past the groups
  x = rng.normal(size=(20, 8))
  w_in, w_gate = rng.normal(size=(2, 4, 8, 12)) / 3
  w_out = rng.normal(size=(4, 12, 8)) / 3
  dy = rng.normal(size=(20, 8))

  def numpy_ffn(x, w_in, w_gate, w_out):
    y, start = np.zeros_like(x), 0
    for g, n in enumerate(sizes):
      rows = x[start : start + n]
      h = ACT[activation](rows @ w_gate[g]) * (rows @ w_in[g]) if gated else ACT[activation](rows @ w_in[g])
      y[start : start + n] = h @ w_out[g]
      start += n
    return y

  def ours(x, w_in, w_gate, w_out):
    return experts.expert_ffn(
      x, jnp.asarray(sizes), w_in, w_out, w_gate if gated else None, activation=activation, backend="pallas_unfused"
    )

  args = [jnp.asarray(a, jnp.float32) for a in (x, w_in, w_gate, w_out)]
  y, vjp = jax.vjp(ours, *args)
  want = numpy_ffn(x, w_in, w_gate, w_out)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
  assert not np.any(np.asarray(y)[16:])
  grads = vjp(jnp.asarray(dy, jnp.float32))
  eps = 1e-6  # float64 central differences of <dy, y> along a random direction, per argument
  for i, a in enumerate((x, w_in, w_gate, w_out)):
    if i == 2 and not gated:
      continue
    direction = rng.normal(size=a.shape)
    shifted = lambda s: [b + s * direction if j == i else b for j, b in enumerate((x, w_in, w_gate, w_out))]
    numeric = (np.sum(dy * numpy_ffn(*shifted(eps))) - np.sum(dy * numpy_ffn(*shifted(-eps)))) / (2 * eps)
    np.testing.assert_allclose(float(np.sum(np.asarray(grads[i]) * direction)), numeric, rtol=1e-3)


@pytest.mark.slow  # the ops are checked against NumPy above and in test_kernels; this is the layer around them
@pytest.mark.parametrize("backend", ["pallas_unfused", "pallas_saved"])
def test_pallas_variant_layers_match_reference(mesh_2x4, backend):
  cfg = MoEConfig(**BASE, expert_backend=backend, transport="hierarchical")
  params = random_params(cfg, 0)
  assert_matches_reference(cfg, mesh_2x4, params, normal(1, (64, 16)))


# ---------------------------------------------------------------------------------------------------------------
# The table and the per-device shape


def test_table_picks_the_fastest_candidate_and_lists_what_did_not_run():
  results = _row(8, 16, 2, 32, "fwd_bwd", {"pallas": 3.0, "ragged_dot": 5.0, "dense_gemm": 1.0, "tokamax": None})
  (row,) = eb.table_from_results(results, {})["shapes"]
  assert row["fastest"] == "pallas" and row["references_median_s"] == {"dense_gemm": 1.0}
  assert row["not_measured"] == {"tokamax": "absent", "pallas_unfused": "not run", "pallas_saved": "not run"}


@pytest.mark.parametrize(
  "fields,mesh,want",
  [
    ({}, (2, 4), (16, 32, 2, 1024 * 2 // 8)),  # experts over all 8 devices, tokens x K over them
    ({"slots_per_device": 3}, (2, 4), (16, 32, 3, 256)),  # a call sees every slot of its device
    ({"esp_schedule": "s1"}, (2, 4), (16, 8, 8, 1024 * 2 // 2)),  # a node's experts, d_ff / 4, the node's rows
    ({"expert_data_parallel": True}, (2, 4), (16, 32, 4, 256)),  # a node's experts on its GPUs
  ],
)
def test_layer_shape(fields, mesh, want):
  shape = eb.layer_shape(MoEConfig(**{**BASE, **fields}), 1024, *mesh)
  assert (shape.d, shape.f, shape.experts, shape.rows) == want
  assert (shape.gated, shape.activation, shape.dtype) == (True, "silu", "float32")


def test_choose_nearest_rows_within_the_ratio_and_refuse_beyond():
  table = eb.table_from_results(
    _row(16, 32, 2, 256, "fwd_bwd", {"pallas": 2.0, "ragged_dot": 1.0})
    + _row(16, 32, 2, 4096, "fwd_bwd", {"pallas": 1.0, "ragged_dot": 2.0})
    + _row(16, 32, 2, 256, "fwd", {"pallas": 1.0, "ragged_dot": 2.0})
    + _row(16, 32, 2, 256, "fwd_bwd", {"pallas": 0.5, "ragged_dot": 2.0}, skew="skewed"),
    dict(dtype="float32"),
  )
  shape = eb.FFNShape(16, 32, 2, 300, True, "silu", "float32")
  assert eb.choose(table, shape, "fwd_bwd")[0] == "ragged_dot"  # balanced groups, 256 rows nearest
  assert eb.choose(table, shape, "fwd")[0] == "pallas"
  assert eb.choose(table, dataclasses.replace(shape, rows=3000), "fwd_bwd")[0] == "pallas"
  with pytest.raises(ConfigError, match=r"20000 rows per device.*4096.*bench_kernels --config\.shape=16,32,2,1,silu"):
    eb.choose(table, dataclasses.replace(shape, rows=20000), "fwd_bwd")
  for other in (dict(f=64), dict(experts=4), dict(gated=False), dict(activation="gelu"), dict(dtype="bfloat16")):
    with pytest.raises(ConfigError, match="no fwd_bwd measurement"):
      eb.choose(table, dataclasses.replace(shape, **other), "fwd_bwd")


def test_shipped_h100_table_is_the_committed_measurements():
  names = ["kernels-mixtral_8x7b.json", "kernels-mixtral_8x7b-tuned-tiles.json", "kernels-qwen2_moe-smile.json"]
  records = [json.loads((H100_RECORDS / n).read_text()) for n in names]
  results, meta = expert_table.merge(records, names)
  shipped = json.loads(open(os.path.join(eb.TABLES_DIR, "nvidia_h100_80gb_hbm3.json")).read())
  assert shipped == json.loads(json.dumps(eb.table_from_results(results, meta)))
  tuned = {
    e["passes"]: e["median_s"]
    for e in records[1]["results"]
    if (e["impl"], e["op"], e["skew"]) == ("pallas", "ffn", "balanced")
  }
  mixtral = {r["passes"]: r for r in shipped["shapes"] if r["model"] == "mixtral_8x7b" and r["skew"] == "balanced"}
  assert {p: r["candidates_median_s"]["pallas"] for p, r in mixtral.items()} == tuned  # the re-run's tiles win
  # What 'auto' picks at a measured shape: Mixtral's 8 experts on one H100, in bf16.
  shape = eb.FFNShape(4096, 14336, 8, 16384, True, "silu", "bfloat16")
  best = min(mixtral["fwd_bwd"]["candidates_median_s"].items(), key=lambda kv: kv[1])[0]
  assert eb.choose(shipped, shape, "fwd_bwd")[0] == best


# ---------------------------------------------------------------------------------------------------------------
# Resolution where the mesh is made, and refusals


def test_resolve_on_a_mesh_and_refusals(mesh_2x4, tmp_path):
  cfg = MoEConfig(**BASE, expert_backend="auto")
  assert eb.resolve(dataclasses.replace(cfg, expert_backend="dense"), 1024, mesh_2x4).expert_backend == "dense"
  with pytest.raises(
    ConfigError,
    match=r"ships tables for \[.nvidia_h100_80gb_hbm3., .nvidia_h200.\], not .cpu.*--config\.shape=16,32,2,1,silu --config\.rows=256",
  ):
    eb.resolve(cfg, 1024, mesh_2x4)
  times = {"pallas": 4e-3, "pallas_unfused": 3e-3, "ragged_dot": 1e-3, "tokamax": None}
  path = _write_table(
    tmp_path, _row(16, 32, 2, 256, "fwd_bwd", times) + _row(16, 32, 2, 256, "fwd", {**times, "pallas": 1e-4})
  )
  with_table = dataclasses.replace(cfg, expert_table=path)
  assert eb.resolve(with_table, 1024, mesh_2x4).expert_backend == "ragged_dot"
  assert eb.resolve(with_table, 1024, mesh_2x4, "fwd").expert_backend == "pallas"
  other = _write_table(tmp_path, _row(16, 32, 2, 256, "fwd_bwd", times), device="NVIDIA H100 80GB HBM3")
  with pytest.raises(ConfigError, match="measured on 'NVIDIA H100 80GB HBM3', this is 'cpu'"):
    eb.resolve(dataclasses.replace(cfg, expert_table=other), 1024, mesh_2x4)
  with pytest.raises(ConfigError, match="does not exist"):
    eb.resolve(dataclasses.replace(cfg, expert_table=str(tmp_path / "nowhere.json")), 1024, mesh_2x4)
  x = normal(1, (64, 16))
  with pytest.raises(ConfigError, match="resolve 'auto' when the config is made"):  # before anything compiles
    moe_apply(random_params(with_table, 0), x, with_table, mesh_2x4)


def test_bad_expert_table_field():
  with pytest.raises(ConfigError, match="expert_table=3"):
    MoEConfig(**BASE, expert_table=3)


@pytest.mark.slow
def test_measured_cpu_table_drives_the_trainer_and_the_layer(mesh_2x4, tmp_path):
  """Measure the candidates here at the layer's per-device shape (bench_kernels), write the table, let the
  Trainer resolve 'auto' from it; the chosen backend's layer equals the reference."""
  from configs import mlm

  config = mlm.get_config()
  config.update(batch_size=8, micro_batches=1, seq_len=32)
  config.moe.update(expert_backend="auto")
  model_cfg, moe_cfg = config_lib.validate(config)
  shape = eb.layer_shape(moe_cfg, 8 * 32, 2, 4)
  model = dict(d=shape.d, f=shape.f, experts=shape.experts, top_k=1, gated=shape.gated, activation=shape.activation)
  assert (
    kernel_cases.custom_model([str(v) for v in (shape.d, shape.f, shape.experts, int(shape.gated), shape.activation)])
    == model
  )
  results = kernels.run(
    {"custom": model},
    [shape.rows],
    ["balanced"],
    ["ffn"],
    ["pallas_unfused", "ragged_dot", "dense_gemm"],
    jnp.float32,
    1,
    3,
  )
  assert all("median_s" in e for e in results)
  table = _write_table(tmp_path, results)
  measured = {e["impl"]: e["median_s"] for e in results if e["passes"] == "fwd_bwd" and e["impl"] != "dense_gemm"}
  config.moe.update(expert_table=table)
  model_cfg, moe_cfg = config_lib.validate(config)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh_2x4, tok, donate=False)
  assert trainer.moe_cfg.expert_backend == min(measured, key=measured.get)
  layer_cfg = dataclasses.replace(trainer.moe_cfg, d_model=16, d_ff=32)
  params = random_params(layer_cfg, 2)
  x = normal(3, (64, 16))
  assert_matches_reference(layer_cfg, mesh_2x4, params, x)


def test_from_hf_resolves_auto_for_the_tokens_of_a_call(mesh_2x4, tmp_path):
  from moejax import models

  path = str(ROOT / "tests" / "data" / "hf" / "qwen3_moe")
  with pytest.raises(ConfigError, match="tokens=None"):
    models.from_hf(path, mesh_2x4, moe={"expert_backend": "auto"})
  shape = eb.layer_shape(models.from_hf(path, mesh_2x4).moe_cfg, 64, 2, 4)
  times = {"pallas": 3e-3, "pallas_unfused": 2e-3, "ragged_dot": 4e-3}
  table = _write_table(
    tmp_path,
    _row(shape.d, shape.f, shape.experts, shape.rows, "fwd", times, gated=shape.gated, activation=shape.activation),
  )
  model = models.from_hf(path, mesh_2x4, moe={"expert_backend": "auto", "expert_table": table}, tokens=64)
  assert model.moe_cfg.expert_backend == "pallas_unfused"
