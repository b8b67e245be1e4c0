"""Fused grouped expert FFN: y = (act(x @ w_gate) * (x @ w_in)) @ w_out, or act(x @ w_in) @ w_out.

Forward: two kernels. The first computes the [M, f] hidden activations with the activation (and
gating product) in its epilogue, writing them once in the compute dtype; the second is gmm.

Backward, by default, recomputes the pre-activations instead of saving them: no [M, f] residual is
kept between the passes (the residuals are the inputs), at the price of re-running the first
matmul(s). One kernel computes dh = dy @ w_out^T together with the recomputed z_gate = x @ w_gate
and z_in = x @ w_in (all contract over d, sharing the K loop), and its epilogue emits h, dz_gate,
dz_in. Then dw_out = tgmm(h, dy), dw_gate = tgmm(x, dz_gate), dw_in = tgmm(x, dz_in) and
dx = dz_gate @ w_gate^T + dz_in @ w_in^T in one kernel.

With save_preactivations the forward's first kernel also writes z_in (and z_gate), kept for the
backward, whose first kernel is then dh = dy @ w_out^T alone, reading them in its epilogue.

Matmul passes of 2 M d f FLOPs each, gated / plain:
  forward                       3 / 2
  backward, recomputing         8 / 5   (dh 1 + recompute 2 / 1, dx 2 / 1, weight gradients 3 / 2)
  backward, pre-activations     6 / 4   (no recompute: the count of XLA's autodiff of an einsum)
so 11 / 7 in all against 9 / 6. The price is memory: z_in and z_gate [M, f] in the compute dtype
live from the forward to the backward, 2 M f elements per layer gated (M f plain), e.g. Mixtral
8x7B at 16384 rows: 16384 x 14336 x 2 x 2 bytes = 0.94 GB per layer in bf16, and the forward
writes them (2 M f more elements of traffic). The recomputing backward keeps no [M, f] array.

Row semantics are gmm's: rows past sum(group_sizes) give zero output and zero dx rows.
Activations are `activations.ACTIVATIONS` (gelu is the tanh approximation).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import activations, backend, checks, tile_order, tuning
from .gmm import tgmm_forward
from .gmm_kernel import grouped_matmul


class Options(NamedTuple):
  """Static settings of an expert_ffn call."""

  activation: str
  tiling: tuning.TileConfig | None  # tiles of every kernel; None: from `tuning`
  interpret: bool
  save_preactivations: bool = False  # keep z_in, z_gate for the backward instead of recomputing them


def _run(kernel, opts, lhs, rhs, rhs_transposed, accumulators, epilogue, out_dtypes, group_sizes, epilogue_inputs=()):
  """grouped_matmul with tiles for `kernel` and the order of its tile visits."""
  m, num_groups = lhs[0].shape[0], rhs[0].shape[0]
  config = opts.tiling or tuning.get_config(
    kernel, backend.device_kind(opts.interpret, lhs[0]), lhs[0].dtype, m, num_groups
  )
  config.validate(opts.interpret)
  visits = tile_order.make_visits(group_sizes, m, config.block_m)
  return grouped_matmul(
    lhs,
    rhs,
    rhs_transposed,
    accumulators,
    epilogue,
    out_dtypes,
    visits,
    config,
    opts.interpret,
    kernel,
    epilogue_inputs,
  )


def _act_and_grad(activation, z):
  return jax.jvp(activations.get_activation(activation), (z,), (jnp.ones_like(z),))


def hidden(x, w_in, w_gate, group_sizes, opts: Options):
  """Kernel 'ffn_in': h = act(x @ w_gate) * (x @ w_in), or act(x @ w_in): [M, f], x's dtype."""
  act = activations.get_activation(opts.activation)
  if w_gate is None:
    [h] = _run("ffn_in", opts, [x], [w_in], [False], [[(0, 0)]], lambda z: (act(z),), [x.dtype], group_sizes)
  else:
    [h] = _run(
      "ffn_in",
      opts,
      [x],
      [w_gate, w_in],
      [False, False],
      [[(0, 0)], [(0, 1)]],
      lambda z_gate, z_in: (act(z_gate) * z_in,),
      [x.dtype],
      group_sizes,
    )
  return h


def hidden_backward(dy, x, w_in, w_out, w_gate, group_sizes, opts: Options):
  """Kernel 'ffn_bwd': dh = dy @ w_out^T with the recomputed pre-activations -> (h, dz_in,
  dz_gate or None), each [M, f] in x's dtype."""
  dtypes = [x.dtype] * (2 if w_gate is None else 3)
  if w_gate is None:

    def epilogue(dh, z_in):
      a, da = _act_and_grad(opts.activation, z_in)
      return a, dh * da

    h, dz_in = _run(
      "ffn_bwd", opts, [dy, x], [w_out, w_in], [True, False], [[(0, 0)], [(1, 1)]], epilogue, dtypes, group_sizes
    )
    return h, dz_in, None

  def gated_epilogue(dh, z_gate, z_in):
    a, da = _act_and_grad(opts.activation, z_gate)
    return a * z_in, dh * a, dh * z_in * da

  return tuple(
    _run(
      "ffn_bwd",
      opts,
      [dy, x],
      [w_out, w_gate, w_in],
      [True, False, False],
      [[(0, 0)], [(1, 1)], [(1, 2)]],
      gated_epilogue,
      dtypes,
      group_sizes,
    )
  )


def hidden_saving(x, w_in, w_gate, group_sizes, opts: Options):
  """Kernel 'ffn_in' keeping the pre-activations -> (h, z_in, z_gate or None), each [M, f] in x's
  dtype."""
  act = activations.get_activation(opts.activation)
  if w_gate is None:
    h, z_in = _run("ffn_in", opts, [x], [w_in], [False], [[(0, 0)]], lambda z: (act(z), z), [x.dtype] * 2, group_sizes)
    return h, z_in, None
  return tuple(
    _run(
      "ffn_in",
      opts,
      [x],
      [w_gate, w_in],
      [False, False],
      [[(0, 0)], [(0, 1)]],
      lambda z_gate, z_in: (act(z_gate) * z_in, z_in, z_gate),
      [x.dtype] * 3,
      group_sizes,
    )
  )


def hidden_backward_saved(dy, z_in, z_gate, w_out, group_sizes, opts: Options):
  """dh = dy @ w_out^T with the kept pre-activations read in the epilogue (tiles of 'ffn_bwd',
  whose epilogue this is) -> (h, dz_in, dz_gate or None), each [M, f] in z_in's dtype."""
  dtypes = [z_in.dtype] * (2 if z_gate is None else 3)
  if z_gate is None:

    def epilogue(dh, z_in):
      a, da = _act_and_grad(opts.activation, z_in)
      return a, dh * da

    h, dz_in = _run("ffn_bwd", opts, [dy], [w_out], [True], [[(0, 0)]], epilogue, dtypes, group_sizes, [z_in])
    return h, dz_in, None

  def gated_epilogue(dh, z_gate, z_in):
    a, da = _act_and_grad(opts.activation, z_gate)
    return a * z_in, dh * a, dh * z_in * da

  return tuple(
    _run("ffn_bwd", opts, [dy], [w_out], [True], [[(0, 0)]], gated_epilogue, dtypes, group_sizes, [z_gate, z_in])
  )


def input_grad(dz_in, dz_gate, w_in, w_gate, group_sizes, opts: Options):
  """dx = dz_in @ w_in^T (+ dz_gate @ w_gate^T, kernel 'ffn_in', else 'gmm'): [M, d]."""
  if w_gate is None:
    [dx] = _run("gmm", opts, [dz_in], [w_in], [True], [[(0, 0)]], lambda acc: (acc,), [dz_in.dtype], group_sizes)
  else:
    [dx] = _run(
      "ffn_in",
      opts,
      [dz_gate, dz_in],
      [w_gate, w_in],
      [True, True],
      [[(0, 0), (1, 1)]],
      lambda acc: (acc,),
      [dz_in.dtype],
      group_sizes,
    )
  return dx


def _output(h, w_out, group_sizes, opts):
  [y] = _run("gmm", opts, [h], [w_out], [False], [[(0, 0)]], lambda acc: (acc,), [h.dtype], group_sizes)
  return y


def _forward(x, w_in, w_out, w_gate, group_sizes, opts):
  """Inputs already promoted to one dtype -> y: [M, d]."""
  return _output(hidden(x, w_in, w_gate, group_sizes, opts), w_out, group_sizes, opts)


def _backward(x, w_in, w_out, w_gate, group_sizes, dy, preactivations, opts):
  """Inputs and dy promoted to one dtype, preactivations (z_in, z_gate) kept by the forward or
  None (recompute) -> (dx, dw_in, dw_out, dw_gate or None)."""

  def tgmm(lhs, rhs):
    return tgmm_forward(lhs, rhs, group_sizes, x.dtype, opts.tiling, opts.interpret)

  if preactivations is None:
    h, dz_in, dz_gate = hidden_backward(dy, x, w_in, w_out, w_gate, group_sizes, opts)
  else:
    h, dz_in, dz_gate = hidden_backward_saved(dy, *preactivations, w_out, group_sizes, opts)
  dx = input_grad(dz_in, dz_gate, w_in, w_gate, group_sizes, opts)
  return dx, tgmm(x, dz_in), tgmm(h, dy), None if w_gate is None else tgmm(x, dz_gate)


def _promote(*arrays):
  dtype = jnp.result_type(*[a for a in arrays if a is not None])
  return [None if a is None else a.astype(dtype) for a in arrays]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ffn(x, w_in, w_out, w_gate, group_sizes, opts):
  return _forward(*_promote(x, w_in, w_out, w_gate), group_sizes, opts)


def _ffn_fwd(x, w_in, w_out, w_gate, group_sizes, opts):
  inputs = (x, w_in, w_out, w_gate, group_sizes)
  if not opts.save_preactivations:
    return _ffn(*inputs, opts), (inputs, None)
  px, pw_in, pw_out, pw_gate = _promote(x, w_in, w_out, w_gate)
  h, z_in, z_gate = hidden_saving(px, pw_in, pw_gate, group_sizes, opts)
  return _output(h, pw_out, group_sizes, opts), (inputs, (z_in, z_gate))


def _ffn_bwd(opts, residuals, dy):
  (x, w_in, w_out, w_gate, group_sizes), preactivations = residuals
  px, pw_in, pw_out, pw_gate, pdy = _promote(x, w_in, w_out, w_gate, dy)
  dx, dw_in, dw_out, dw_gate = _backward(
    px, pw_in, pw_out, pw_gate, group_sizes, pdy.astype(px.dtype), preactivations, opts
  )
  return (
    dx.astype(x.dtype),
    dw_in.astype(w_in.dtype),
    dw_out.astype(w_out.dtype),
    None if w_gate is None else dw_gate.astype(w_gate.dtype),
    None,
  )


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def expert_ffn(
  x: jax.Array,
  w_in: jax.Array,
  w_out: jax.Array,
  group_sizes: jax.Array,
  activation: str = "gelu",
  w_gate: jax.Array | None = None,
  *,
  tiling: tuning.TileConfig | None = None,
  interpret: bool | None = None,
  save_preactivations: bool = False,
) -> jax.Array:
  """Grouped expert FFN over rows grouped by expert (rows of group g use expert g's weights).

  Args:
    x: [M, d] floating, rows grouped as in `gmm.gmm`.
    w_in: [G, d, f]; w_out: [G, f, d]; w_gate: None (plain FFN) or [G, d, f] (gated, GLU).
    group_sizes: [G] integer, >= 0; rows past their sum give zero output rows.
    activation: 'gelu' (tanh approximation), 'relu' or 'silu'.
    tiling: tile sizes for every kernel, overriding `tuning`.
    interpret: run in the Pallas interpreter (default: unless on a GPU).
    save_preactivations: keep z_in (and z_gate), [M, f] each, from the forward for the backward
      instead of recomputing them (2 fewer matmul passes gated, 1 plain; see the module docstring).
  Returns:
    y: [M, d] in the promoted input dtype. Differentiable in x and the weights.
  """
  checks.check_rank("x", x, 2, "[M, d]")
  checks.check_rank("w_in", w_in, 3, "[G, d, f]")
  checks.check_rank("w_out", w_out, 3, "[G, f, d]")
  num_groups, d, f = w_in.shape
  checks.check_dim("w_in", w_in, 1, x.shape[1], "x.shape[1] (d)")
  checks.check_dim("w_out", w_out, 0, num_groups, "w_in.shape[0] (G)")
  checks.check_dim("w_out", w_out, 1, f, "w_in.shape[2] (f)")
  checks.check_dim("w_out", w_out, 2, d, "x.shape[1] (d)")
  if w_gate is not None:
    checks.check_rank("w_gate", w_gate, 3, "[G, d, f]")
    for axis, size in enumerate(w_in.shape):
      checks.check_dim("w_gate", w_gate, axis, size, f"w_in.shape[{axis}]")
  for name, a in (("x", x), ("w_in", w_in), ("w_out", w_out), ("w_gate", w_gate)):
    if a is not None:
      checks.check_floating(name, a)
  checks.check_group_sizes(group_sizes, num_groups, "w_in.shape[0]")
  activations.get_activation(activation)
  opts = Options(activation, tiling, backend.use_interpret(interpret, x, w_in), bool(save_preactivations))
  return _ffn(x, w_in, w_out, w_gate, group_sizes, opts)
