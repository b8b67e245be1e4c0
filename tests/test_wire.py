"""The wire's dtypes: FP8 rows against a NumPy model of DeepSeek-V3's block quantisation, the layer with a
quantised dispatch against the reference on the quantised rows (and the plain reference within e4m3's bound),
non-finite tokens counted, the lowered GPU program's exchange dtypes, and the bytes accounted."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax.moe import wire
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.reference import moe_reference
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from tests import helpers


def _numpy_fp8(x):
  """float64 model: per row, blocks of 128 elements, scale = amax / 448, elements rounded to e4m3 (ml_dtypes)."""
  out = np.empty_like(x, np.float64)
  for r in range(x.shape[0]):
    for start in range(0, x.shape[1], 128):
      block = x[r, start : start + 128].astype(np.float64)
      amax = np.abs(block).max()
      scale = np.float32(amax / 448.0) if amax > 0 else np.float32(1.0)
      q = (block.astype(np.float32) / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
      out[r, start : start + 128] = q * np.float64(scale)
  return out


def test_fp8_rows_match_block_quantisation_and_keep_non_finite():
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((6, 300)) * rng.lognormal(0, 2, (6, 1))).astype(np.float32)  # 3 blocks, the last partial
  x[2, 130:140] = 0.0
  x[3, 128:256] = 0.0  # a block of zeros
  got = np.asarray(wire.round_trip(jnp.asarray(x), wire.FP8), np.float64)
  np.testing.assert_allclose(got, _numpy_fp8(x), rtol=1e-6, atol=0)
  assert wire.encode(jnp.asarray(x), wire.FP8).shape == (6, 300 + 4 * 3)
  assert np.abs(got - x).max() <= np.abs(x).max() * 2**-4  # e4m3: 3 mantissa bits
  bad = x.copy()
  bad[1, 5] = np.inf
  decoded = np.asarray(wire.round_trip(jnp.asarray(bad), wire.FP8))
  assert not np.isfinite(decoded[1, :128]).any() and np.isfinite(decoded[1, 128:]).all()
  assert wire.payload_bytes(wire.FP8, 300, 4) == 300 + 12 < wire.payload_bytes("bfloat16", 300, 4) == 600


@pytest.mark.sampled(1)
@pytest.mark.parametrize(
  "fields",
  [
    {},
    {"path": "node_first"},
    {"schedule": "comet", "num_chunks": 2},
    {"esp_schedule": "s1"},
    {"dedup": False},
    {"buffer_factor": 2.0},
    {"routing": "node_limited", "num_nodes": 2, "node_top_k": 1},
  ],
)
def test_fp8_dispatch_equals_the_reference_on_quantised_rows(mesh_2x4, fields):
  """FP8 dispatch, float32 combine: the reference whose experts see the quantised rows, to 1e-5 (fp32), gradients
  too; the unquantised reference within e4m3's relative error (2^-4)."""
  cfg = MoEConfig(num_experts=16, top_k=4, d_model=200, d_ff=32, dispatch_dtype=wire.FP8, **fields)
  params = helpers.random_params(cfg, 3)
  x = helpers.normal(4, (256, 200)) * 3
  groups = 2 if cfg.esp_schedule == "s2" else 8

  def loss(fn, p, v):
    y, aux = fn(p, v)
    return jnp.sum(y * jnp.cos(v)) + aux["aux_loss"], y

  layer = lambda p, v: moe_apply(p, v, cfg, mesh_2x4)
  quantised = lambda p, v: moe_reference(p, v, cfg, dispatch_groups=groups, expert_x=wire.round_trip(v, wire.FP8))
  (_, y), g = jax.jit(jax.value_and_grad(lambda p, v: loss(layer, p, v), has_aux=True))(params, x)
  (_, y_q), g_q = jax.jit(jax.value_and_grad(lambda p, v: loss(quantised, p, v), has_aux=True))(params, x)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(y, y_q) < 1e-5
  for name in ("router", "w_in", "w_out"):
    assert (
      rel(g[name] if name != "router" else g[name]["kernel"], g_q[name] if name != "router" else g_q[name]["kernel"])
      < 1e-4
    ), name
  y_ref, _ = jax.jit(lambda p, v: moe_reference(p, v, cfg, dispatch_groups=groups))(params, x)
  assert 1e-3 < rel(y, y_ref) < 2**-4  # quantised, within e4m3's bound


def test_bf16_combine_rounds_the_results_only(mesh_2x4):
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=64, d_ff=32, combine_dtype="bfloat16")
  params, x = helpers.random_params(cfg, 5), helpers.normal(6, (128, 64))
  y, _ = moe_apply(params, x, cfg, mesh_2x4)
  y_ref, _ = moe_reference(params, x, cfg)
  rel = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
  assert 1e-6 < rel < 2**-8  # bf16 rounding of each returned row


def test_non_finite_tokens_are_counted(mesh_2x4):
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=64, d_ff=32, dispatch_dtype=wire.FP8)
  params, x = helpers.random_params(cfg, 7), np.asarray(helpers.normal(8, (128, 64)))
  x[[3, 70, 71]] = np.nan
  x[100, 0] = np.inf
  y, aux = moe_apply(params, jnp.asarray(x), cfg, mesh_2x4)
  assert int(aux["nonfinite_tokens"]) == 4
  assert not np.isfinite(np.asarray(y)[[3, 70, 71, 100]]).all(axis=1).any()


def test_traffic_bytes_count_payload_scales_ids_weights_and_results(mesh_2x4):
  """Bytes from s to p: rows out x (FP8 payload, its scales, 4-byte id and weight per slot) plus the rows p sent
  s back x (d in bf16)."""
  d, k = 200, 2
  cfg = MoEConfig(num_experts=16, top_k=k, d_model=d, d_ff=32, dispatch_dtype=wire.FP8, combine_dtype="bfloat16")
  _, aux = moe_apply(helpers.random_params(cfg, 9), helpers.normal(10, (128, d)), cfg, mesh_2x4)
  rows = np.asarray(aux["traffic_rows"], np.float64)
  out_bytes, back_bytes = d + 4 * 2 + k * (4 + 4), 2 * d
  want = rows * out_bytes + np.swapaxes(rows, -1, -2) * back_bytes
  np.testing.assert_allclose(np.asarray(aux["traffic_bytes"]), want, rtol=1e-6)


def test_lowered_program_moves_fp8_and_bf16_rows(devices, monkeypatch):
  """FP8 dispatch and BF16 combine (the GPU program, lowered for CUDA without a GPU): every exchange of rows
  (payload columns) carries e4m3 out and bf16 back, the backward's gradients bf16 both ways; only the ids
  (int32) and the per-slot weights (float32, K columns) are 32-bit."""
  monkeypatch.setattr(platform_lib, "RAGGED_PLATFORMS", (*platform_lib.RAGGED_PLATFORMS, "cpu"))
  d = 256
  cfg = MoEConfig(
    num_experts=8,
    top_k=2,
    d_model=d,
    d_ff=32,
    path="node_first",
    collective="auto",
    dispatch_dtype=wire.FP8,
    combine_dtype="bfloat16",
  )
  mesh = mesh_lib.make_mesh(2, 4)
  params, x = helpers.random_params(cfg, 11), helpers.normal(12, (8 * 16, d))

  def loss(p, v):
    y, aux = moe_apply(p, v, cfg, mesh)
    return jnp.sum(y) + aux["aux_loss"]

  text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
  operands = helpers.RAGGED_OPERAND.findall(text)
  widths = {(int(cols), dtype) for cols, dtype in operands}
  assert (d + 4 * 2, "f8E4M3FN") in widths and (d, "bf16") in widths, widths
  assert all(dtype in ("f8E4M3FN", "bf16") for cols, dtype in widths if cols >= d), widths
  assert {dtype for cols, dtype in widths if cols < d} <= {"i32", "f32"}, widths
