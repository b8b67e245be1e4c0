"""Qwen3-Next's and Qwen3.5-MoE's gated DeltaNet layer (transformers' `Qwen3NextGatedDeltaNet`,
`Qwen3_5MoeGatedDeltaNet`) as one pure function over a dict of the layer's tensors, named and laid out as
transformers stores them under `model.layers.{i}.linear_attn.`:

  Qwen3-Next   in_proj_qkvz.weight [2 Hk K + 2 H V, D]: per key head group, its q, k, then its r value heads' v,
               then their z (r = H / Hk); in_proj_ba.weight [2 H, D]: per group, its r b then its r a
  Qwen3.5-MoE  in_proj_qkv.weight [2 Hk K + H V, D] (all q, all k, all v), in_proj_z.weight [H V, D],
               in_proj_b.weight [H, D], in_proj_a.weight [H, D]
  both         conv1d.weight [2 Hk K + H V, 1, kernel] (depthwise, no bias), dt_bias [H], A_log [H],
               norm.weight [V], out_proj.weight [D, H V]

The layer: the projections, a short causal depthwise convolution with SiLU over q, k and v, q and k L2-normalised,
beta = sigmoid(b), the decay g = -exp(A_log) softplus(a + dt_bias), the gated delta rule (`delta_rule`), an RMSNorm
per value head gated by silu(z), the output projection. The decode cache is the convolution's last kernel - 1 inputs
and the rule's state.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moejax.models.mixers.delta_rule import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from moejax.validation import require


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
  """The layer's shapes: D = hidden_size, Hk key heads of K = head_k_dim, H value heads of V = head_v_dim."""

  hidden_size: int
  num_k_heads: int
  num_v_heads: int
  head_k_dim: int
  head_v_dim: int
  conv_kernel: int = 4
  rms_eps: float = 1e-6
  chunk: int = 64  # the chunked rule's chunk (any size gives the same result; transformers uses 64)

  def __post_init__(self):
    for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel", "chunk"):
      value = getattr(self, name)
      require(isinstance(value, int) and value >= 1, name, value, "a positive int")
    ratio = "a multiple of num_k_heads (each key head serves num_v_heads / num_k_heads value heads)"
    require(self.num_v_heads % self.num_k_heads == 0, "num_v_heads", self.num_v_heads, ratio)

  @property
  def key_dim(self) -> int:
    return self.num_k_heads * self.head_k_dim

  @property
  def value_dim(self) -> int:
    return self.num_v_heads * self.head_v_dim

  @property
  def conv_dim(self) -> int:
    return 2 * self.key_dim + self.value_dim

  @classmethod
  def from_hf(cls, config: dict) -> "GatedDeltaNetConfig":
    """From a Qwen3-Next config.json, or Qwen3.5-MoE's (whose decoder fields sit under `text_config`)."""
    text = config.get("text_config", config)
    act = text.get("hidden_act", "silu")
    require(act == "silu", "hidden_act", act, "silu (the convolution's activation in transformers' layer)")
    return cls(
      hidden_size=text["hidden_size"],
      num_k_heads=text["linear_num_key_heads"],
      num_v_heads=text["linear_num_value_heads"],
      head_k_dim=text["linear_key_head_dim"],
      head_v_dim=text["linear_value_head_dim"],
      conv_kernel=text.get("linear_conv_kernel_dim", 4),
      rms_eps=text.get("rms_norm_eps", 1e-6),
    )


def empty_cache(cfg: GatedDeltaNetConfig, batch: int, dtype=jnp.float32) -> dict:
  """The decode cache before any token: `conv` [B, kernel - 1, conv_dim] (in the activations' dtype) and
  `recurrent` [B, H, K, V] float32, zeros (a prefill from it equals one without a cache)."""
  return {
    "conv": jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
    "recurrent": jnp.zeros((batch, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32),
  }


def causal_conv1d(x_BxSxC: jax.Array, weight_CxW: jax.Array, state=None):
  """The depthwise causal convolution with SiLU (transformers' `causal_conv1d_fn`, `causal_conv1d_update`):
  y[t, c] = silu(sum_j weight[c, j] x[t - W + 1 + j, c]), the inputs before the first taken from `state`
  [B, W - 1, C] (None: zeros). Returns (y_BxSxC, new_state_BxW-1xC: the last W - 1 inputs), so calls on
  consecutive pieces of a sequence, one token or many, give the whole sequence's convolution."""
  b, s, c = x_BxSxC.shape
  width = weight_CxW.shape[-1]
  if state is None:
    state = jnp.zeros((b, width - 1, c), x_BxSxC.dtype)
  padded = jnp.concatenate([state.astype(x_BxSxC.dtype), x_BxSxC], axis=1)
  weight = weight_CxW.astype(x_BxSxC.dtype)
  y = sum(weight[:, j] * padded[:, j : j + s] for j in range(width))
  return jax.nn.silu(y), padded[:, s:]


def gated_rms_norm(x, z, weight, eps: float, activation=jax.nn.silu, strict_float32: bool = False) -> jax.Array:
  """weight * x / sqrt(mean(x^2) + eps) * activation(z) over the last axis (transformers' `Qwen3NextRMSNormGated`:
  statistics and gate in float32, the weight times the normed x in x's dtype, the norm before the gate; Kimi
  Linear's `KimiLinearRMSNormGated`: activation sigmoid, strict_float32, the weight's product in float32 too)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if strict_float32:
    weighted = weight.astype(jnp.float32) * normed
  else:
    weighted = (weight * normed.astype(x.dtype)).astype(jnp.float32)
  return (weighted * activation(z.astype(jnp.float32))).astype(x.dtype)


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
  """x [..., in] @ weight [out, in]^T (torch's Linear layout)."""
  return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def _project(params: dict, x_BxSxD: jax.Array, cfg: GatedDeltaNetConfig):
  """The input projections in either family's layout -> (qkv_BxSxC: all q, all k, all v as the convolution's
  channels; z_BxSxHxV; b_BxSxH; a_BxSxH)."""
  b, s, _ = x_BxSxD.shape
  h, hk, kd, vd = cfg.num_v_heads, cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
  if "in_proj_qkv.weight" in params:  # Qwen3.5-MoE: already in the convolution's order
    qkv = _linear(x_BxSxD, params["in_proj_qkv.weight"])
    z = _linear(x_BxSxD, params["in_proj_z.weight"]).reshape(b, s, h, vd)
    return qkv, z, _linear(x_BxSxD, params["in_proj_b.weight"]), _linear(x_BxSxD, params["in_proj_a.weight"])
  # Qwen3-Next: rows grouped per key head ([q, k, v of its r value heads, their z] per group), regrouped here
  rep = h // hk
  qkvz = _linear(x_BxSxD, params["in_proj_qkvz.weight"]).reshape(b, s, hk, 2 * kd + 2 * rep * vd)
  q, k, v, z = jnp.split(qkvz, [kd, 2 * kd, 2 * kd + rep * vd], axis=-1)
  ba = _linear(x_BxSxD, params["in_proj_ba.weight"]).reshape(b, s, hk, 2 * rep)
  qkv = jnp.concatenate([t.reshape(b, s, -1) for t in (q, k, v)], axis=-1)
  return qkv, z.reshape(b, s, h, vd), ba[..., :rep].reshape(b, s, h), ba[..., rep:].reshape(b, s, h)


def gated_deltanet_mixer(params: dict, x_BxSxD: jax.Array, cfg: GatedDeltaNetConfig, cache=None, mask_BxS=None):
  """The gated DeltaNet layer (transformers' `Qwen3NextGatedDeltaNet.forward`): x_BxSxD -> (y_BxSxD, new_cache).

  `params`: the layer's tensors as the module docstring lists them. `cache`: None (a sequence from its start) or
  {"conv", "recurrent"} (`empty_cache`'s shapes) from the call that ended just before `x`; the new cache is always
  returned, so a prefill followed by single-token calls gives the longer sequence's output. `mask_BxS` (1: token,
  0: padding) zeroes padding tokens' inputs as transformers does.
  """
  b, s, _ = x_BxSxD.shape
  if mask_BxS is not None:
    x_BxSxD = x_BxSxD * mask_BxS[..., None].astype(x_BxSxD.dtype)
  qkv, z, b_proj, a_proj = _project(params, x_BxSxD, cfg)
  conv_state = None if cache is None else cache["conv"]
  qkv, conv_state = causal_conv1d(qkv, params["conv1d.weight"][:, 0, :], conv_state)
  q, k, v = jnp.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
  q = l2_normalize(q.reshape(b, s, cfg.num_k_heads, cfg.head_k_dim))
  k = l2_normalize(k.reshape(b, s, cfg.num_k_heads, cfg.head_k_dim))
  v = v.reshape(b, s, cfg.num_v_heads, cfg.head_v_dim)
  beta = jax.nn.sigmoid(b_proj.astype(jnp.float32))
  # the decay in log space, float32 so that exp(A_log) never overflows in a half dtype (as transformers)
  dt = a_proj.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32)
  g = -jnp.exp(params["A_log"].astype(jnp.float32)) * jax.nn.softplus(dt)
  state = None if cache is None else cache["recurrent"]
  if cache is not None and s == 1:  # one decoded token: the plain step, no chunk padding
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
  else:
    o, state = chunked_gated_delta_rule(q, k, v, g, beta, chunk=cfg.chunk, initial_state=state)
  o = gated_rms_norm(o.astype(x_BxSxD.dtype), z, params["norm.weight"], cfg.rms_eps)
  y = _linear(o.reshape(b, s, cfg.value_dim), params["out_proj.weight"])
  return y, {"conv": conv_state, "recurrent": state}
