"""The PyTorch anchor of the kernels benchmark (moejax/bench/torch_ffn.py): the same FFN math as the
JAX implementations (checked on CPU with per-group torch matmuls where torch is installed), and
skipped with its reason where torch or CUDA is missing."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.bench import kernel_impls, torch_ffn
from tests.helpers import ENV, ROOT


def test_bench_kernels_imports_without_torch_and_says_why_it_skips():
  code = (
    "import sys; sys.modules['torch'] = None\n"
    "from experiments import bench_kernels\nfrom moejax.bench import kernel_impls\n"
    "print(kernel_impls.unavailable('torch_grouped_mm', 'bfloat16'))\n"
    "print(kernel_impls.unavailable('ragged_dot', 'bfloat16'))"
  )
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == [
    "torch not importable (ModuleNotFoundError: import of torch halted; None in sys.modules)",
    "None",
  ]


def test_float32_is_not_a_grouped_mm_dtype():
  reason = kernel_impls.unavailable("torch_grouped_mm", jnp.float32)
  assert reason and ("float32" in reason or "torch" in reason)


@pytest.mark.parametrize("gated,activation,op", [(True, "silu", "ffn"), (False, "gelu", "ffn"), (True, "silu", "gmm")])
def test_torch_ffn_matches_ragged_dot_with_per_group_matmuls(gated, activation, op):
  torch = pytest.importorskip("torch")
  model = dict(d=16, f=32, experts=4, top_k=2, gated=gated, activation=activation)
  sizes = np.array([5, 0, 17, 10])  # an empty group and uneven ones; 32 rows, all in groups
  rows = int(sizes.sum())
  x, w_in, w_out, w_gate, dy = torch_ffn.make_inputs(model, rows, op, "cpu", dtype=torch.float32)
  offs = torch_ffn.offsets(sizes, "cpu")
  params = (x, w_in, w_out, w_gate)
  ours = torch_ffn.run_once(params, dy, offs, activation, op, True, torch_ffn.grouped_mm_loop)

  # The same inputs in kernel_impls' layout ([G, in, out] weights, params (x, w_in, w_out[, w_gate])).
  to_jax = lambda t: jnp.asarray(t.detach().numpy())
  jparams = (to_jax(x), to_jax(w_in).transpose(0, 2, 1))
  if op == "ffn":
    jparams += (to_jax(w_out).transpose(0, 2, 1),)
    if gated:
      jparams += (to_jax(w_gate).transpose(0, 2, 1),)
  fn = kernel_impls.make_fn("ragged_dot", op, model, capacity=32)
  gs = jnp.asarray(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda p: fn(p, gs), jparams)
  grads = vjp(to_jax(dy))[0]
  np.testing.assert_allclose(ours[0].numpy(), y, rtol=1e-4, atol=1e-4)
  # torch grads: x, w_in, w_out, w_gate (present ones), in torchtitan's [G, out, in] layout.
  expected = [grads[0], grads[1].transpose(0, 2, 1)]
  if op == "ffn":
    expected.append(grads[2].transpose(0, 2, 1))
    if gated:
      expected.append(grads[3].transpose(0, 2, 1))
  assert len(ours) == 1 + len(expected)
  for got, want in zip(ours[1:], expected):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
