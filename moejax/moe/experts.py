"""Expert compute: a grouped FFN over rows sorted by local expert.

Every backend computes, for the rows of group g (contiguous, in order),
  y = act(x @ w_gate[g]) * (x @ w_in[g]) @ w_out[g]   (gated), or  act(x @ w_in[g]) @ w_out[g],
with fp32 accumulation; rows past sum(group_sizes) give zeros.
"""

import functools

import jax
import jax.numpy as jnp

from moejax.kernels import ffn as pallas_ffn
from moejax.kernels.activations import ACTIVATIONS  # One definition for every backend (gelu: tanh form).


def _hidden(h_in, h_gate, activation):
  act = ACTIVATIONS[activation]
  return act(h_in) if h_gate is None else act(h_gate) * h_in


def ffn_ragged_dot(x_RxD, group_sizes_G, w_in, w_out, w_gate, activation):
  """jax.lax.ragged_dot backend."""
  mm = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes_G, preferred_element_type=jnp.float32)
  h_gate = None if w_gate is None else mm(x_RxD, w_gate)
  h_RxF = _hidden(mm(x_RxD, w_in), h_gate, activation).astype(x_RxD.dtype)
  return mm(h_RxF, w_out)


def ffn_dense(x_RxD, group_sizes_G, w_in, w_out, w_gate, activation):
  """Reference backend: every expert on every row, masked to its group (G times the FLOPs)."""
  ends = jnp.cumsum(group_sizes_G)
  starts = ends - group_sizes_G
  row = jnp.arange(x_RxD.shape[0])
  y = jnp.zeros((x_RxD.shape[0], w_out.shape[-1]), jnp.float32)
  for g in range(w_in.shape[0]):
    mm = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    h_gate = None if w_gate is None else mm(x_RxD, w_gate[g])
    h = _hidden(mm(x_RxD, w_in[g]), h_gate, activation).astype(x_RxD.dtype)
    in_group = (row >= starts[g]) & (row < ends[g])
    y = y + jnp.where(in_group[:, None], mm(h, w_out[g]), 0.0)
  return y


def ffn_pallas(x_RxD, group_sizes_G, w_in, w_out, w_gate, activation):
  """Fused Pallas kernels (moejax.kernels; the Pallas interpreter on CPU)."""
  return pallas_ffn.expert_ffn(x_RxD, w_in, w_out, group_sizes_G, activation, w_gate=w_gate).astype(jnp.float32)


BACKENDS = {"ragged_dot": ffn_ragged_dot, "dense": ffn_dense, "pallas": ffn_pallas}


def expert_ffn(x_RxD, group_sizes_G, w_in_GxDxF, w_out_GxFxD, w_gate_GxDxF, *, activation: str, backend: str,
               dtype=jnp.float32):
  """Grouped FFN: x [R, d], group_sizes [G] -> [R, d] fp32, computed in `dtype`."""
  cast = lambda a: None if a is None else a.astype(dtype)
  return BACKENDS[backend](cast(x_RxD), group_sizes_G.astype(jnp.int32), cast(w_in_GxDxF), cast(w_out_GxFxD),
                           cast(w_gate_GxDxF), activation)
