"""Kimi Linear's Kimi delta attention (KDA; transformers' `KimiLinearDeltaAttention`) as one pure function over a dict
of the layer's tensors, named and laid out as the published checkpoints store them under `model.layers.{i}.self_attn.`
(transformers' conversion moves f_a_proj, f_b_proj, dt_bias and A_log under `forget_gate.` and stacks the three
convolutions in memory; its save_pretrained writes them back so):

  q_proj.weight, k_proj.weight, v_proj.weight [H K, D]; q_conv1d.weight, k_conv1d.weight, v_conv1d.weight [H K, 1,
  kernel] (depthwise, no bias); f_a_proj.weight [K, D], f_b_proj.weight [H K, K], dt_bias [H K], A_log [1, 1, H, 1];
  b_proj.weight [H, D]; g_a_proj.weight [K, D], g_b_proj.weight [H K, K]; o_norm.weight [K]; o_proj.weight [D, H K]

The layer: q, k and v projected, each through its short causal convolution with SiLU, q and k L2-normalised; a decay
per key channel from a low-rank forget gate, g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias) [H, K]; beta =
sigmoid(b_proj(x)); the delta rule with that per-channel decay (`delta_rule`, which Qwen3-Next's gated DeltaNet runs
with one decay per head); an RMSNorm per head gated by sigmoid(g_b(g_a(x))) in float32; o_proj. H heads of K for q, k
and v alike. The decode cache: the convolution's last kernel - 1 inputs (the q, k, v channels) and the rule's state.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moejax.models.mixers.delta_rule import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from moejax.models.mixers.gated_deltanet import causal_conv1d, gated_rms_norm
from moejax.validation import require

CONVOLUTIONS = ("q_conv1d", "k_conv1d", "v_conv1d")  # the convolution's channels, in this order


@dataclasses.dataclass(frozen=True)
class KimiDeltaConfig:
  """The layer's shapes: D = hidden_size, H = num_heads heads of K = head_dim (q, k and v alike)."""

  hidden_size: int
  num_heads: int
  head_dim: int
  conv_kernel: int = 4
  rms_eps: float = 1e-5
  chunk: int = 64  # the chunked rule's chunk (any size gives the same result; transformers uses 64)

  def __post_init__(self):
    for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel", "chunk"):
      value = getattr(self, name)
      require(isinstance(value, int) and value >= 1, name, value, "a positive int")

  @property
  def width(self) -> int:
    """H K: each of q, k and v."""
    return self.num_heads * self.head_dim

  @property
  def conv_dim(self) -> int:
    return 3 * self.width

  @classmethod
  def from_hf(cls, config: dict) -> "KimiDeltaConfig":
    """From a Kimi Linear config.json: transformers' linear_* fields, or the published linear_attn_config."""
    sub = config.get("linear_attn_config") or {}
    act = config.get("hidden_act", "silu")
    require(act == "silu", "hidden_act", act, "silu (the convolution's activation in transformers' layer)")
    return cls(
      hidden_size=config["hidden_size"],
      num_heads=sub.get("num_heads", config.get("linear_num_heads", 32)),
      head_dim=sub.get("head_dim", config.get("linear_head_dim", 128)),
      conv_kernel=sub.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", 4)),
      rms_eps=config.get("rms_norm_eps", 1e-5),
    )


def empty_cache(cfg: KimiDeltaConfig, batch: int, dtype=jnp.float32) -> dict:
  """The decode cache before any token: `conv` [B, kernel - 1, 3 H K] (in the activations' dtype) and `recurrent`
  [B, H, K, K] float32, zeros (a prefill from it equals one without a cache)."""
  return {
    "conv": jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
    "recurrent": jnp.zeros((batch, cfg.num_heads, cfg.head_dim, cfg.head_dim), jnp.float32),
  }


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
  """x [..., in] @ weight [out, in]^T (torch's Linear layout)."""
  return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def channel_decay(params: dict, x_BxSxD: jax.Array, cfg: KimiDeltaConfig) -> jax.Array:
  """The log decay per key channel, g [B, S, H, K] float32 (transformers' `KimiLinearForgetGate`): -exp(A_log[h])
  softplus(f_b(f_a(x)) + dt_bias), in float32 so that exp(A_log) never overflows in a half dtype."""
  b, s, _ = x_BxSxD.shape
  low_rank = _linear(_linear(x_BxSxD, params["f_a_proj.weight"]), params["f_b_proj.weight"])
  dt = (low_rank.astype(jnp.float32) + params["dt_bias"].astype(jnp.float32)).reshape(b, s, cfg.num_heads, -1)
  return -jnp.exp(params["A_log"].astype(jnp.float32).reshape(cfg.num_heads, 1)) * jax.nn.softplus(dt)


def kimi_delta_mixer(params: dict, x_BxSxD: jax.Array, cfg: KimiDeltaConfig, cache=None, mask_BxS=None):
  """The KDA layer (transformers' `KimiLinearDeltaAttention.forward`): x_BxSxD -> (y_BxSxD, new_cache).

  `params`: the layer's tensors as the module docstring lists them. `cache`: None (a sequence from its start) or
  {"conv", "recurrent"} (`empty_cache`'s shapes) from the call that ended just before `x`; the new cache is always
  returned, so a prefill followed by single-token calls gives the longer sequence's output. `mask_BxS` (1: token,
  0: padding) zeroes padding tokens' inputs as transformers does.
  """
  b, s, _ = x_BxSxD.shape
  h, kd = cfg.num_heads, cfg.head_dim
  if mask_BxS is not None:
    x_BxSxD = x_BxSxD * mask_BxS[..., None].astype(x_BxSxD.dtype)
  qkv = jnp.concatenate([_linear(x_BxSxD, params[f"{p}_proj.weight"]) for p in "qkv"], axis=-1)
  weight_CxW = jnp.concatenate([params[f"{name}.weight"][:, 0, :] for name in CONVOLUTIONS], axis=0)
  qkv, conv_state = causal_conv1d(qkv, weight_CxW, None if cache is None else cache["conv"])
  q, k, v = (t.reshape(b, s, h, kd) for t in jnp.split(qkv, 3, axis=-1))
  q, k = l2_normalize(q), l2_normalize(k)
  beta = jax.nn.sigmoid(_linear(x_BxSxD, params["b_proj.weight"]).astype(jnp.float32))
  g = channel_decay(params, x_BxSxD, cfg)  # [B, S, H, K]: the rule's per-channel case
  state = None if cache is None else cache["recurrent"]
  if cache is not None and s == 1:  # one decoded token: the plain step, no chunk padding
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
  else:
    o, state = chunked_gated_delta_rule(q, k, v, g, beta, chunk=cfg.chunk, initial_state=state)
  gate = _linear(_linear(x_BxSxD, params["g_a_proj.weight"]), params["g_b_proj.weight"]).reshape(b, s, h, kd)
  o = gated_rms_norm(o.astype(x_BxSxD.dtype), gate, params["o_norm.weight"], cfg.rms_eps, jax.nn.sigmoid, True)
  y = _linear(o.reshape(b, s, cfg.width), params["o_proj.weight"])
  return y, {"conv": conv_state, "recurrent": state}
