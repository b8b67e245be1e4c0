"""The learned projections of grouped-query attention and what the families do to them before RoPE: q, k and v from
x, QK-norm over each head (Qwen3, GLM-4.5, dots1) or over the whole q and k projections (OLMoE, MiniMax-M2; the
modes: `moejax.models.qk_norm`), and OLMoE's clip_qkv. `moejax.models.attention` runs them, RoPE, a QK-norm after
RoPE (HunYuan) and the softmax.

Parameters keep the checkpoints' names (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm) as attributes of the
attention module; a kernel is the transpose of a torch Linear weight.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import qk_norm
from moejax.models.decoder_config import DecoderConfig
from moejax.models.rms_norm import RMSNorm


def linear(cfg: DecoderConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  dtypes = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
  return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=nnx.initializers.normal(0.02), rngs=rngs, **dtypes)


def gqa_linears(cfg: DecoderConfig, rngs: nnx.Rngs) -> tuple[nnx.Linear, ...]:
  """(q_proj [d, H W], k_proj [d, H_kv W], v_proj [d, H_kv W_v], o_proj [H W_v, d]) (W_v: cfg.value_dim), biased as
  qkv_bias and out_bias; with gated_attention q_proj [d, H 2W], per head its query and its gate."""
  h, kv, w, wv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.value_dim, cfg.d_model
  return (
    linear(cfg, d, h * w * (2 if cfg.gated_attention else 1), cfg.qkv_bias, rngs),
    linear(cfg, d, kv * w, cfg.qkv_bias, rngs),
    linear(cfg, d, kv * wv, cfg.qkv_bias, rngs),
    linear(cfg, h * wv, d, cfg.out_bias, rngs),
  )


def qk_norms(cfg: DecoderConfig) -> tuple[RMSNorm | None, RMSNorm | None]:
  """(q_norm, k_norm) of cfg.qk_norm_mode (`qk_norm.QkNorm.shapes`); (None, None) without QK-norm."""
  return qk_norm.of(cfg).norms(cfg) if cfg.qk_norm else (None, None)


def project_qkv(attn: nnx.Module, x_BxSxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """x [B, S, d] -> q [B, S, H, W], k [B, S, H_kv, W] and v [B, S, H_kv, W_v] (times value_scale: MiMo-V2-Flash)
  through `attn`'s projections (`gqa_linears`), q and k QK-normed where cfg.qk_norm_mode acts before RoPE (the flat projection, before it is split into heads, or each
  head), then each clipped to +-clip_qkv where set (OLMoE: after the norm, as transformers); and the output gate
  [B, S, H W] of gated_attention (q_proj's second half of each head, Qwen3-Next), else None."""
  cfg, mode = attn.cfg, qk_norm.of(attn.cfg)
  (b, s, _), w = x_BxSxD.shape, cfg.head_dim
  q, k, v = attn.q_proj(x_BxSxD), attn.k_proj(x_BxSxD), attn.v_proj(x_BxSxD)  # [B, S, heads x W]
  gate = None
  if cfg.gated_attention:  # per head [query | gate], as transformers' view(..., heads, 2W).chunk(2)
    q, gate = (a.reshape(b, s, -1) for a in jnp.split(q.reshape(b, s, -1, 2 * w), 2, axis=-1))
  q, k = mode.apply(qk_norm.ON_PROJECTION, attn.q_norm, attn.k_norm, q, k)
  q_BxSxHxW, k_BxSxHxW = (a.reshape(b, s, -1, w) for a in (q, k))
  v_BxSxHxW = v.reshape(b, s, -1, cfg.value_dim)
  if cfg.value_scale != 1:  # MiMo-V2-Flash's attention_value_scale, on the values as projected (and cached)
    v_BxSxHxW = v_BxSxHxW * cfg.value_scale
  q_BxSxHxW, k_BxSxHxW = mode.apply(qk_norm.BEFORE_ROPE, attn.q_norm, attn.k_norm, q_BxSxHxW, k_BxSxHxW)
  if cfg.clip_qkv is not None:
    clip = lambda a: jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv)
    q_BxSxHxW, k_BxSxHxW, v_BxSxHxW = clip(q_BxSxHxW), clip(k_BxSxHxW), clip(v_BxSxHxW)
  return q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, gate
