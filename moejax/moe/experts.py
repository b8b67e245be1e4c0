"""Expert compute: a grouped FFN over rows sorted by local expert.

Every backend computes, for the rows of group g (contiguous, in order),
  y = act(x @ w_gate[g]) * (x @ w_in[g]) @ w_out[g]   (gated), or  act(x @ w_in[g]) @ w_out[g],
with fp32 accumulation; rows past sum(group_sizes) give zeros. With biases (`MoEConfig.ffn_bias`, gpt-oss) each
matmul adds its expert's row b_gate[g], b_in[g] [f] or b_out[g] [d]; the clamped SwiGLUs (gpt-oss's, DeepSeek-V4's:
`GATED_ONLY`) are gated activations of both pre-activations (`Activation`). The fused Pallas FFN (`Backend.fused`) computes neither; the config
refuses them there.
"""

import importlib.util
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels import ffn as pallas_ffn
from kernels import fp8, gmm
from kernels.activations import ACTIVATIONS  # One definition for every backend (gelu: tanh form).
from moejax.runtime import platform as platform_lib
from moejax.validation import require

CLAMPED_SWIGLU = "swiglu_clamped"  # gpt-oss's
CLAMPED_SWIGLU_V4 = "swiglu_clamped_v4"  # DeepSeek-V4's
# The experts' ops carry this name scope in a compiled program's metadata, so a profile can tell them apart.
SCOPE = "expert_ffn"


class Backend(NamedTuple):
  """One value of `MoEConfig.expert_backend`: its name and what callers ask of it. pallas: it runs the kernels'
  Pallas kernels (compiled on GPU, interpreted elsewhere); fused: the whole FFN in two kernels (kernels.ffn: no
  biases, ACTIVATIONS only), saves_preactivations: keeping the [R, f] pre-activations for the backward; needs: the
  package it imports on first use (installed as the extra of that name); needs_resolving: 'auto', the fastest
  measured, chosen when the config is made (`moejax.cost.expert_backend.resolve`)."""

  name: str
  pallas: bool = False
  fused: bool = False
  saves_preactivations: bool = False
  needs: str | None = None
  needs_resolving: bool = False

  def interprets_on(self, platform: str) -> bool:
    """Whether its kernels run in the Pallas interpreter on `platform` (not compiled)."""
    return self.pallas and platform_lib.pallas_interprets(platform)

  def check(self, cfg) -> None:
    """Raises ConfigError naming the field where these experts cannot run on this backend, or it is missing."""
    require(
      self.needs is None or importlib.util.find_spec(self.needs) is not None,
      "expert_backend",
      self.name,
      f"{self.needs} installed (pip install 'moejax[{self.needs}]'; Python >= 3.12, jax >= 0.11.1)",
    )
    why = fused_refusal(cfg)
    require(
      not self.fused or why is None,
      "expert_backend",
      self.name,
      f"not {FUSED} here: {why}; 'ragged_dot', 'pallas_unfused', 'tokamax' or 'dense' run them",
    )


BACKENDS = {
  b.name: b
  for b in (
    Backend("ragged_dot"),
    Backend("dense"),
    Backend("pallas", pallas=True, fused=True),
    Backend("pallas_saved", pallas=True, fused=True, saves_preactivations=True),
    Backend("pallas_unfused", pallas=True),
    Backend("tokamax", needs="tokamax"),
    Backend("fp8"),
    Backend("auto", needs_resolving=True),
  )
}
FUSED = tuple(b.name for b in BACKENDS.values() if b.fused)


def of(cfg) -> Backend:
  """The expert backend of `cfg.expert_backend`."""
  return BACKENDS[cfg.expert_backend]


def fused_refusal(cfg) -> str | None:
  """Why the fused Pallas FFN (`Backend.fused`) cannot run these experts, or None."""
  if cfg.ffn_bias or cfg.activation in GATED_ONLY:
    return (
      f"its kernels compute act(x w_gate) * (x w_in) w_out with activation in {tuple(ACTIVATIONS)}, not "
      f"ffn_bias={cfg.ffn_bias} with activation={cfg.activation!r}"
    )
  return None


def _swiglu_gpt_oss(gate_F, up_F, alpha: float, limit: float):
  """gpt-oss's: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) ([..., f] each)."""
  gate_F = jnp.minimum(gate_F, limit)
  return (jnp.clip(up_F, -limit, limit) + 1) * gate_F * jax.nn.sigmoid(alpha * gate_F)


def _swiglu_v4(gate_F, up_F, alpha: float, limit: float):
  """DeepSeek-V4's: silu(min(gate, limit)) * clip(up, -limit, limit) ([..., f] each; alpha unused)."""
  del alpha
  return jax.nn.silu(jnp.minimum(gate_F, limit)) * jnp.clip(up_F, -limit, limit)


# The clamped SwiGLUs: functions of both pre-activations (gated experts only), (gate, up, alpha, limit) -> hidden
# units; the fused Pallas FFN runs none of them.
GATED_ONLY = {CLAMPED_SWIGLU: _swiglu_gpt_oss, CLAMPED_SWIGLU_V4: _swiglu_v4}


class Activation(NamedTuple):
  """The experts' activation: `name` one of ACTIVATIONS, or one of GATED_ONLY (gated experts only): 'swiglu_clamped'
  (gpt-oss), (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit); 'swiglu_clamped_v4'
  (DeepSeek-V4), silu(min(gate, limit)) * clip(up, -limit, limit)."""

  name: str
  alpha: float = 1.702
  limit: float = 7.0

  @classmethod
  def of(cls, cfg) -> "Activation":
    return cls(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)

  def __call__(self, a_gate, a_in=None):
    """The hidden units of the pre-activations (fp32 [..., f]): act(a_gate) * a_in (gated), or act(a_gate)."""
    if self.name in GATED_ONLY:
      return GATED_ONLY[self.name](a_gate, a_in, self.alpha, self.limit)
    act = ACTIVATIONS[self.name](a_gate)
    return act if a_in is None else act * a_in


def row_bias(b_GxX, group_sizes_G, rows: int):
  """[rows, X] fp32: each row's group's bias b[g] (rows past the groups: 0)."""
  g_R = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(rows), side="right")
  return jnp.concatenate([b_GxX.astype(jnp.float32), jnp.zeros((1, b_GxX.shape[1]), jnp.float32)])[g_R]


def _tokamax():
  """The tokamax package, imported on first use of expert_backend='tokamax' (moejax runs without it)."""
  try:
    import tokamax
  except ImportError as e:
    raise ImportError(
      "expert_backend='tokamax' needs the tokamax package (Python >= 3.12, jax >= 0.11.1): "
      "pip install 'moejax[tokamax]', or use expert_backend='ragged_dot'"
    ) from e
  return tokamax


def grouped_matmul(x_RxI, w_GxIxO, group_sizes_G, backend: str):
  """Row i of group g times w[g]: x [R, I], w [G, I, O] -> [R, O] fp32 (I in, O out widths); rows past the
  groups give 0."""
  if backend == "ragged_dot":
    return jax.lax.ragged_dot(x_RxI, w_GxIxO, group_sizes_G, preferred_element_type=jnp.float32)
  if backend == "tokamax":
    # Output in the input dtype (fp32 accumulation inside): tokamax's GPU backward refuses an fp32 cotangent
    # against bf16 weights ("lhs and rhs must have same dtype"; H200, 2026-11-28).
    y = _tokamax().ragged_dot(x_RxI, w_GxIxO, group_sizes_G, preferred_element_type=x_RxI.dtype).astype(jnp.float32)
    # tokamax's GPU kernels need not write the rows past the groups (its zero_initialize is TPU-only).
    in_groups = jnp.arange(x_RxI.shape[0])[:, None] < jnp.sum(group_sizes_G)
    return jnp.where(in_groups, y, 0.0)
  if BACKENDS[backend].pallas:
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


def expert_hidden(
  x_RxD,
  group_sizes_G,
  w_in_GxDxF,
  w_gate_GxDxF,
  *,
  activation: str | Activation,
  backend: str,
  dtype=jnp.float32,
  b_in_GxF=None,
  b_gate_GxF=None,
):
  """The first half of the FFN: x [R, d] -> h [R, f] in `dtype` (act(x w_gate + b_gate) * (x w_in + b_in), or
  act(x w_in + b_in); biases [G, f] or None)."""
  x_RxD = x_RxD.astype(dtype)
  act = activation if isinstance(activation, Activation) else Activation(activation)

  def mm(w, b):
    y = grouped_matmul(x_RxD, w.astype(dtype), group_sizes_G, backend)
    return y if b is None else y + row_bias(b, group_sizes_G, x_RxD.shape[0])

  with jax.named_scope(SCOPE):
    h_RxF = (
      act(mm(w_in_GxDxF, b_in_GxF))
      if w_gate_GxDxF is None
      else act(mm(w_gate_GxDxF, b_gate_GxF), mm(w_in_GxDxF, b_in_GxF))
    )
    return h_RxF.astype(dtype)


def expert_output(h_RxF, group_sizes_G, w_out_GxFxD, *, backend: str, dtype=jnp.float32, b_out_GxD=None):
  """The second half: h [R, f] -> [R, d'] fp32 (d' = w_out's columns; a column block of d is fine, with the
  same columns of b_out [G, d'], or None)."""
  with jax.named_scope(SCOPE):
    y = grouped_matmul(h_RxF.astype(dtype), w_out_GxFxD.astype(dtype), group_sizes_G, backend)
    return y if b_out_GxD is None else y + row_bias(b_out_GxD, group_sizes_G, h_RxF.shape[0])


def expert_ffn(
  x_RxD,
  group_sizes_G,
  w_in_GxDxF,
  w_out_GxFxD,
  w_gate_GxDxF,
  *,
  activation: str | Activation,
  backend: str,
  dtype=jnp.float32,
  biases: dict | None = None,
):
  """Grouped FFN: x [R, d], group_sizes [G] -> [R, d] fp32, computed in `dtype`. biases: None or {'b_in',
  'b_gate' [G, f], 'b_out' [G, d]}. The 'pallas' backend
  runs the fused kernels (kernels.ffn: no [R, f] residual kept for the backward, the first matmuls
  recomputed), 'pallas_saved' the same kernels keeping the [R, f] pre-activations for the backward instead;
  'pallas_unfused' a gmm per matmul, whose backward keeps the hidden activations; 'fp8' each matmul in FP8
  (kernels.fp8)."""
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  biases = biases or {}
  if BACKENDS[backend].fused:
    name = activation.name if isinstance(activation, Activation) else activation  # the kernel refuses the others
    if biases:
      raise ValueError(
        f"expert_backend={backend!r} (the fused Pallas FFN) adds no expert biases: use 'ragged_dot' or 'pallas_unfused'"
      )
    cast = lambda a: None if a is None else a.astype(dtype)
    with jax.named_scope(SCOPE):
      return pallas_ffn.expert_ffn(
        cast(x_RxD),
        cast(w_in_GxDxF),
        cast(w_out_GxFxD),
        group_sizes_G,
        name,
        w_gate=cast(w_gate_GxDxF),
        save_preactivations=BACKENDS[backend].saves_preactivations,
      ).astype(jnp.float32)
  h_RxF = expert_hidden(
    x_RxD,
    group_sizes_G,
    w_in_GxDxF,
    w_gate_GxDxF,
    activation=activation,
    backend=backend,
    dtype=dtype,
    b_in_GxF=biases.get("b_in"),
    b_gate_GxF=biases.get("b_gate"),
  )
  return expert_output(h_RxF, group_sizes_G, w_out_GxFxD, backend=backend, dtype=dtype, b_out_GxD=biases.get("b_out"))


def shared_experts(x_TxD, params, cfg, sum_over: str | None = None):
  """The shared experts on every token: x [T, d] -> [T, d] fp32 (one dense FFN of the shared width,
  optionally gated by Qwen2-MoE's sigmoid(x w_g)). sum_over: the mesh axis whose devices hold d_ff slices
  (expert sharding: 'gpu'), over which the partial outputs are summed, as the dense FFN's are under tensor
  parallelism; None: whole shared experts."""
  shared, dtype, act = params["shared"], jnp.dtype(cfg.dtype), Activation.of(cfg)
  mm = lambda a, w: jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  h = act(mm(x_TxD, shared["w_in"])) if not cfg.gated else act(mm(x_TxD, shared["w_gate"]), mm(x_TxD, shared["w_in"]))
  y = mm(h, shared["w_out"])
  if sum_over is not None:
    y = jax.lax.psum(y, sum_over)
  if cfg.shared_gate:
    y = jax.nn.sigmoid(x_TxD.astype(jnp.float32) @ params["shared_gate"]["kernel"].astype(jnp.float32)) * y
  return y
