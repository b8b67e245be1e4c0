"""expert_backend='fp8' (kernels.fp8, qwix's FP8 ragged_dot): exactly the product of the e4m3-quantized operands
(float64 NumPy with ml_dtypes' e4m3 rounding), within FP8's tolerance of the unquantized product and of the bf16
backend in the layer, straight-through gradients, and a missing qwix named before anything is traced."""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import fp8
from moejax.moe import experts
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from tests.helpers import normal, random_params, relative_error

# name: (rows, group sizes): an empty group and rows past the groups; every row in one group.
SIZES = {"skewed": (24, [0, 13, 1, 6]), "one_group_all_rows": (24, [0, 0, 24, 0])}
K, N = 40, 24


def np_quantized(a, axis):
  """a (float32) as e4m3 values times absmax / 448 scales over `axis`, as float64: what FP8 represents of it."""
  scale = (np.abs(a).max(axis, keepdims=True) / np.float32(448)).astype(np.float32)
  return (a / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def np_ragged_dot(x, w, sizes):
  out, start = np.zeros((x.shape[0], w.shape[2])), 0
  for g, n in enumerate(sizes):
    out[start : start + n] = x[start : start + n] @ w[g]
    start += n
  return out


def draws(seed, rows, groups):
  rng = np.random.default_rng(seed)
  return (
    rng.standard_normal((rows, K)).astype(np.float32),
    (rng.standard_normal((groups, K, N)) / 6).astype(np.float32),
    rng.standard_normal((rows, N)).astype(np.float32),
  )


@pytest.mark.parametrize("case", sorted(SIZES))
def test_fp8_ragged_dot_is_the_product_of_the_quantized_operands(case):
  rows, sizes = SIZES[case]
  x, w, dy = draws(len(case), rows, len(sizes))
  used = sum(sizes)
  x_nan = x.copy()
  x_nan[used:] = np.nan  # rows past the groups hold garbage in a receive buffer: never in an output or gradient
  gs = jnp.array(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda a, b: fp8.ragged_dot(a, b, gs), jnp.asarray(x_nan), jnp.asarray(w))
  assert y.dtype == jnp.float32 and not np.any(np.asarray(y)[used:])
  quantized = np_ragged_dot(np_quantized(x[:used], 1), np_quantized(w, 1), sizes)[:used]
  exact = np_ragged_dot(x[:used], w, sizes)[:used]
  assert relative_error(y[:used], quantized) < 1e-5  # fp32 accumulation of the FP8 values' products
  assert 1e-3 < relative_error(y[:used], exact) < 6e-2  # e4m3 keeps 3 mantissa bits: a few percent, not zero
  dx, dw = vjp(jnp.asarray(dy))  # straight-through: the unquantized product's gradients
  dy_used = np.where(np.arange(rows)[:, None] < used, dy, 0.0)
  assert relative_error(dx[:used], np_ragged_dot(dy_used, np.swapaxes(w, 1, 2), sizes)[:used]) < 1e-5
  assert not np.any(np.asarray(dx)[used:])
  starts = np.cumsum(sizes) - sizes
  want_dw = np.stack([x[s : s + n].astype(np.float64).T @ dy[s : s + n] for s, n in zip(starts, sizes)])
  assert relative_error(dw, want_dw) < 1e-5


@pytest.mark.slow  # the op itself is checked against NumPy above; this is the layer around it
def test_fp8_layer_within_fp8_tolerance_of_the_bf16_backend(mesh_2x4):
  """The MoE layer (padded exchange, 2 x 4 mesh, gated experts) in bf16 with 'fp8' against 'ragged_dot' experts:
  outputs and gradients a few percent apart (two FP8 matmuls in a row, each within e4m3's half step of 2^-4 per
  element; 6% and 4-8% seen), and not equal (the matmuls did run in FP8)."""
  cfgs = [
    MoEConfig(
      num_experts=8,
      top_k=2,
      d_model=32,
      d_ff=64,
      path="flat",
      collective="padded",
      gated=True,
      activation="silu",
      dtype="bfloat16",
      expert_backend=b,
    )
    for b in ("ragged_dot", "fp8")
  ]
  params = random_params(cfgs[0], 0)
  x = normal(1, (64, 32))

  def loss(p, v, cfg):
    y, aux = moe_apply(p, v, cfg, mesh_2x4)
    return jnp.sum(y * y) + aux["aux_loss"], y

  (_, y_bf16), g_bf16 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cfgs[0])
  (_, y_fp8), g_fp8 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cfgs[1])
  assert 1e-3 < relative_error(y_fp8, y_bf16) < 1e-1
  for a, b in zip(jax.tree.leaves(g_fp8), jax.tree.leaves(g_bf16)):
    assert relative_error(a, b) < 1.5e-1


def test_missing_qwix_names_the_fix(monkeypatch):
  monkeypatch.setitem(sys.modules, "qwix", None)  # import qwix raises ImportError
  with pytest.raises(ImportError, match=r"expert_backend='fp8'.*moejax\[fp8\]"):
    experts.grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.array([2], jnp.int32), "fp8")


@pytest.mark.parametrize(
  "args,offending",
  [
    (((4, 3), (2, 5, 6), [2, 2]), r"w.shape\[1\]=5"),
    (((4, 3), (2, 3, 6), [4]), "group_sizes"),
    (((4,), (2, 3, 6), [2, 2]), "x must be 2-D"),
  ],
)
def test_bad_inputs_are_refused_by_name(args, offending):
  x_shape, w_shape, sizes = args
  with pytest.raises(ValueError, match=offending):
    fp8.ragged_dot(jnp.ones(x_shape), jnp.ones(w_shape), jnp.array(sizes, jnp.int32))


def test_fp8_contraction_lowers_for_cuda_on_fp8_operands():
  """Lowered for CUDA (no GPU needed): the grouped matmul is a chlo.ragged_dot of two float8_e4m3fn operands into
  float32, the scales applied outside it."""
  x, w, gs = jnp.ones((16, K), jnp.bfloat16), jnp.ones((3, K, N), jnp.bfloat16), jnp.array([4, 0, 12], jnp.int32)
  text = jax.jit(fp8.ragged_dot).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
  dots = [line for line in text.splitlines() if "chlo.ragged_dot" in line and "f8E4M3FN" in line]
  assert len(dots) == 1 and f"tensor<16x{K}xf8E4M3FN>, tensor<3x{K}x{N}xf8E4M3FN>" in dots[0], dots
  assert f"-> tensor<16x{N}xf32>" in dots[0]
