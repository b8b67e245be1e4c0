"""The JAX implementations of the expert FFN that the kernel benchmark times (moejax.bench.kernels; each described in
experiments/bench_kernels.py's docstring): each one a function fn(params, group_sizes) -> y, its inputs, and why one
cannot run here."""

import jax
import jax.numpy as jnp

from kernels import activations, ffn, fp8
from kernels import gmm as gmm_lib
from moejax.moe import experts as experts_lib

# The first five are what MoEConfig.expert_backend runs for the whole FFN (moejax.cost.expert_backend.CANDIDATES,
# ranked for expert_backend='auto'); 'fp8' is expert_backend='fp8' too, never ranked (it changes the numerics); the
# others are references.
IMPLS = (
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


def _hidden(act, z_in, z_gate):
  return act(z_in) if z_gate is None else act(z_gate) * z_in


def _ragged(ragged_dot, op, act):
  def fn(params, gs):
    x, w_in = params[:2]
    z_in = ragged_dot(x, w_in, gs)
    if op == "gmm":
      return z_in
    z_gate = ragged_dot(x, params[3], gs) if len(params) == 4 else None
    return ragged_dot(_hidden(act, z_in, z_gate).astype(x.dtype), params[2], gs)

  return fn


def _capacity_dispatch(x, gs, experts, capacity):
  """x: [R, d] grouped rows -> [G, capacity, d] and the flat slot index of every row."""
  rows = x.shape[0]
  starts = jnp.cumsum(gs) - gs
  group = jnp.repeat(jnp.arange(experts), gs, total_repeat_length=rows)
  slot = group * capacity + jnp.arange(rows) - starts[group]
  buf = jnp.zeros((experts * capacity, x.shape[1]), x.dtype).at[slot].set(x)
  return buf.reshape(experts, capacity, -1), slot


def _capacity(op, act, capacity):
  def fn(params, gs):
    x, w_in = params[:2]
    experts = w_in.shape[0]
    xg, slot = _capacity_dispatch(x, gs, experts, capacity)
    y = jnp.einsum("gcd,gdf->gcf", xg, w_in)
    if op == "ffn":
      z_gate = jnp.einsum("gcd,gdf->gcf", xg, params[3]) if len(params) == 4 else None
      y = jnp.einsum("gcf,gfd->gcd", _hidden(act, y, z_gate).astype(x.dtype), params[2])
    return y.reshape(experts * capacity, -1)[slot]

  return fn


def _dense(op, act):
  def fn(params, gs):
    del gs
    x, w_in = params[:2]
    y = x @ w_in[0]
    if op == "ffn":
      z_gate = x @ params[3][0] if len(params) == 4 else None
      y = _hidden(act, y, z_gate).astype(x.dtype) @ params[2][0]
    return y

  return fn


def _pallas(op, act, save_preactivations):
  def fn(params, gs):
    if op == "gmm":  # one matmul: nothing to keep, the same call for both FFN variants
      return gmm_lib.gmm(*params, gs)
    return ffn.expert_ffn(
      *params[:3], gs, act, params[3] if len(params) == 4 else None, save_preactivations=save_preactivations
    )

  return fn


def _as_layer_runs_it(backend, op, activation):
  """expert_backend=`backend` as the layer runs it (moejax.moe.experts: fp32 out, computed in x's dtype)."""

  def fn(params, gs):
    x, w_in = params[:2]
    if op == "gmm":
      return experts_lib.grouped_matmul(x, w_in, gs, backend)
    w_gate = params[3] if len(params) == 4 else None
    return experts_lib.expert_ffn(x, gs, w_in, params[2], w_gate, activation=activation, backend=backend, dtype=x.dtype)

  return fn


def unavailable(impl, dtype) -> str | None:
  """Why `impl` cannot run here (a missing optional package or device), or None."""
  if impl in ("tokamax", "fp8"):
    try:
      experts_lib._tokamax() if impl == "tokamax" else fp8._qwix()  # pylint: disable=protected-access
    except ImportError as e:
      return f"{e} ({type(e.__cause__ or e).__name__}: {e.__cause__ or e})"
  if impl == "torch_grouped_mm":
    try:
      import torch  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      return f"torch not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
      return f"torch {torch.__version__}: no CUDA device (torch._grouped_mm runs on CUDA only)"
    if not hasattr(torch, "_grouped_mm"):
      return f"torch {torch.__version__} has no torch._grouped_mm (2.8 or newer has it)"
    if jnp.dtype(dtype) != jnp.bfloat16:
      return f"torch._grouped_mm runs bfloat16 only, not {jnp.dtype(dtype).name}"
  return None


def make_fn(impl, op, model, capacity):
  """fn(params, group_sizes) -> y; params: (x, w_in) for 'gmm', (x, w_in, w_out[, w_gate])."""
  act = activations.get_activation(model["activation"])
  if impl in ("pallas", "pallas_saved"):
    return _pallas(op, model["activation"], impl == "pallas_saved")
  if impl == "pallas_unfused":
    return _ragged(gmm_lib.gmm, op, act)
  if impl == "ragged_dot":
    return _ragged(jax.lax.ragged_dot, op, act)
  if impl in ("tokamax", "fp8"):
    return _as_layer_runs_it(impl, op, model["activation"])
  if impl == "dense_capacity":
    return _capacity(op, act, capacity)
  if impl == "dense_gemm":
    return _dense(op, act)
  raise ValueError(f"unknown implementation {impl!r}")


def make_inputs(model, rows, dtype, op, impl, seed=0):
  """params (see make_fn) and the output cotangent; dense_gemm gets one expert."""
  d, f = model["d"], model["f"]
  experts = 1 if impl == "dense_gemm" else model["experts"]
  keys = jax.random.split(jax.random.key(seed), 5)

  def normal(key, shape, scale=1.0):
    return (scale * jax.random.normal(key, shape)).astype(dtype)

  params = (normal(keys[0], (rows, d)), normal(keys[1], (experts, d, f), d**-0.5))
  if op == "ffn":
    params += (normal(keys[2], (experts, f, d), f**-0.5),)
    if model["gated"]:
      params += (normal(keys[3], (experts, d, f), d**-0.5),)
  return params, normal(keys[4], (rows, f if op == "gmm" else d))
