"""Expert compute: a grouped FFN over rows sorted by local expert.

Every backend computes, for the rows of group g (contiguous, in order),
  y = act(x @ w_gate[g]) * (x @ w_in[g]) @ w_out[g]   (gated), or  act(x @ w_in[g]) @ w_out[g],
with fp32 accumulation; rows past sum(group_sizes) give zeros.
"""

import jax
import jax.numpy as jnp

from moejax.kernels import ffn as pallas_ffn
from moejax.kernels import fp8, gmm
from moejax.kernels.activations import ACTIVATIONS  # One definition for every backend (gelu: tanh form).


def _tokamax():
  """The tokamax package, imported on first use of expert_backend='tokamax' (moejax runs without it)."""
  try:
    import tokamax
  except ImportError as e:
    raise ImportError("expert_backend='tokamax' needs the tokamax package (Python >= 3.12, jax >= 0.11.1): "
                      "pip install 'moejax[tokamax]', or use expert_backend='ragged_dot'") from e
  return tokamax


def grouped_matmul(x_RxI, w_GxIxO, group_sizes_G, backend: str):
  """Row i of group g times w[g]: x [R, I], w [G, I, O] -> [R, O] fp32 (I in, O out widths); rows past the
  groups give 0."""
  if backend == "ragged_dot":
    return jax.lax.ragged_dot(x_RxI, w_GxIxO, group_sizes_G, preferred_element_type=jnp.float32)
  if backend == "tokamax":
    y = _tokamax().ragged_dot(x_RxI, w_GxIxO, group_sizes_G, preferred_element_type=jnp.float32)
    # tokamax's GPU kernels need not write the rows past the groups (its zero_initialize is TPU-only).
    in_groups = jnp.arange(x_RxI.shape[0])[:, None] < jnp.sum(group_sizes_G)
    return jnp.where(in_groups, y, 0.0)
  if backend in ("pallas", "pallas_saved", "pallas_unfused"):
    return gmm.gmm(x_RxI, w_GxIxO, group_sizes_G, preferred_element_type=jnp.float32)
  if backend == "fp8":
    return fp8.ragged_dot(x_RxI, w_GxIxO, group_sizes_G)
  # dense: every group on every row, masked to its own (G times the FLOPs; the reference speed).
  ends = jnp.cumsum(group_sizes_G)
  row = jnp.arange(x_RxI.shape[0])[:, None]
  y = jnp.zeros((x_RxI.shape[0], w_GxIxO.shape[-1]), jnp.float32)
  for g in range(w_GxIxO.shape[0]):
    in_group = (row >= ends[g] - group_sizes_G[g]) & (row < ends[g])
    y = y + jnp.where(in_group, jnp.dot(x_RxI, w_GxIxO[g], preferred_element_type=jnp.float32), 0.0)
  return y


def expert_hidden(x_RxD, group_sizes_G, w_in_GxDxF, w_gate_GxDxF, *, activation: str, backend: str,
                  dtype=jnp.float32):
  """The first half of the FFN: x [R, d] -> h [R, f] in `dtype` (act(x w_gate) * x w_in, or act(x w_in))."""
  x_RxD = x_RxD.astype(dtype)
  mm = lambda w: grouped_matmul(x_RxD, w.astype(dtype), group_sizes_G, backend)
  act = ACTIVATIONS[activation]
  h_RxF = act(mm(w_in_GxDxF)) if w_gate_GxDxF is None else act(mm(w_gate_GxDxF)) * mm(w_in_GxDxF)
  return h_RxF.astype(dtype)


def expert_output(h_RxF, group_sizes_G, w_out_GxFxD, *, backend: str, dtype=jnp.float32):
  """The second half: h [R, f] -> [R, d'] fp32 (d' = w_out's columns; a column block of d is fine)."""
  return grouped_matmul(h_RxF.astype(dtype), w_out_GxFxD.astype(dtype), group_sizes_G, backend)


def expert_ffn(x_RxD, group_sizes_G, w_in_GxDxF, w_out_GxFxD, w_gate_GxDxF, *, activation: str, backend: str,
               dtype=jnp.float32):
  """Grouped FFN: x [R, d], group_sizes [G] -> [R, d] fp32, computed in `dtype`. The 'pallas' backend
  runs the fused kernels (moejax.kernels.ffn: no [R, f] residual kept for the backward, the first matmuls
  recomputed), 'pallas_saved' the same kernels keeping the [R, f] pre-activations for the backward instead;
  'pallas_unfused' a gmm per matmul, whose backward keeps the hidden activations; 'fp8' each matmul in FP8
  (moejax.kernels.fp8)."""
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  if backend in ("pallas", "pallas_saved"):
    cast = lambda a: None if a is None else a.astype(dtype)
    return pallas_ffn.expert_ffn(cast(x_RxD), cast(w_in_GxDxF), cast(w_out_GxFxD), group_sizes_G, activation,
                                 w_gate=cast(w_gate_GxDxF),
                                 save_preactivations=backend == "pallas_saved").astype(jnp.float32)
  h_RxF = expert_hidden(x_RxD, group_sizes_G, w_in_GxDxF, w_gate_GxDxF, activation=activation, backend=backend,
                        dtype=dtype)
  return expert_output(h_RxF, group_sizes_G, w_out_GxFxD, backend=backend, dtype=dtype)


def shared_experts(x_TxD, params, cfg, sum_over: str | None = None):
  """The shared experts on every token: x [T, d] -> [T, d] fp32 (one dense FFN of the shared width,
  optionally gated by Qwen2-MoE's sigmoid(x w_g)). sum_over: the mesh axis whose devices hold d_ff slices
  (expert sharding: 'gpu'), over which the partial outputs are summed, as the dense FFN's are under tensor
  parallelism; None: whole shared experts."""
  shared, dtype, act = params["shared"], jnp.dtype(cfg.dtype), ACTIVATIONS[cfg.activation]
  mm = lambda a, w: jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  h = act(mm(x_TxD, shared["w_in"])) if not cfg.gated else act(mm(x_TxD, shared["w_gate"])) * mm(x_TxD, shared["w_in"])
  y = mm(h, shared["w_out"])
  if sum_over is not None:
    y = jax.lax.psum(y, sum_over)
  if cfg.shared_gate:
    y = jax.nn.sigmoid(x_TxD.astype(jnp.float32) @ params["shared_gate"]["kernel"].astype(jnp.float32)) * y
  return y
