"""LongCat-Flash's shortcut-connected MoE layer (ScMoE), a block kind of the decoder (`Family.block`
'shortcut_moe'; the usual pre-norm block is 'sequential', `decoder.DecoderLayer`). One layer holds two attention
sublayers and two dense SwiGLU FFNs; the MoE layer reads the first attention's normed output and its output is added
at the layer's end, so its exchange can overlap the second attention and FFN (the ScMoE paper's point):

  x1 = x + attn[0](ln_attn[0](x));  h = ln_ffn[0](x1);  m = moe(h);  x2 = x1 + mlps[0](h)
  x3 = x2 + attn[1](ln_attn[1](x2));  y = x3 + mlps[1](ln_ffn[1](x3)) + m

as transformers' LongcatFlashDecoderLayer. The attention is MLA with LongCat's LoRA scaling (`LoraScaledMLA`).
The block has the layer's interface (x -> (x, aux), or with a cache (x, aux, cache)); its cache is one pair whose
arrays hold both attentions' on an axis of 2 after the sequence's ([B, S, 2, kv_lora_rank], [B, S, 2,
qk_rope_head_dim]: `cache_specs`), so the cache's layout, sharding and scans are every layer's. Its parameters are
named as the checkpoint's (`attn/j` -> `self_attn.j`, `ln_attn/j` -> `input_layernorm.j`, `ln_ffn/j` ->
`post_attention_layernorm.j`, `mlps/j`, `ffn/moe` -> `mlp`). ExFlow's decode runs it in two halves around the MoE
layer's hops (`attend`: the first attention; `after_experts`: the rest, where the row then is, plus the MoE output).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import attention, families
from moejax.models.backbone import MoEFFN
from moejax.models.rms_norm import RMSNorm, block_norm

SHORTCUT = "shortcut_moe"
SUBLAYERS = 2  # attention + FFN sublayers per layer


def uses(cfg) -> bool:
  """Whether a model config's layers are ScMoE layers (its family's `block`); SMILE's configs never."""
  family = getattr(cfg, "family", None)
  return family in families.REGISTRY and families.get(family).block == SHORTCUT


def refusal(cfg) -> str | None:
  """Why a config's layers cannot run as an attention half and an FFN half (the family remedies study's loop), or
  None."""
  if uses(cfg):
    return (
      "LongCat-Flash's ScMoE layers (two attentions and the MoE branch in one layer) have no attention and FFN halves"
    )
  return None


class _ScaledLinear(nnx.Linear):
  """nnx.Linear whose output is multiplied by `factor` (its parameters named as nnx.Linear's)."""

  def __init__(self, *args, factor: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.factor = factor

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x) * jnp.asarray(self.factor, x.dtype)


class _ScaledRMSNorm(RMSNorm):
  """RMSNorm whose output is multiplied by `factor` (its weight named as RMSNorm's)."""

  def __init__(self, *args, factor: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.factor = factor

  def __call__(self, x: jax.Array) -> jax.Array:
    return super().__call__(x) * jnp.asarray(self.factor, x.dtype)


class LoraScaledMLA(attention.LatentAttention):
  """DeepSeek's MLA (q through its latent always) with LongCat-Flash's LoRA scaling: q (its non-rotary and rotary
  parts) times sqrt(d_model / q_lora_rank) after q_b_proj, the normed kv latent times sqrt(d_model / kv_lora_rank)
  after kv_a_layernorm (so the cache, the keys and the values all see it): transformers' mla_scale_q_lora and
  mla_scale_kv_lora, applied where it applies them."""

  def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
    super().__init__(cfg, layer, rngs=rngs)
    h, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
    self.q_b_proj = _ScaledLinear(
      cfg.q_lora_rank,
      h * qk,
      use_bias=False,
      kernel_init=nnx.initializers.normal(0.02),
      rngs=rngs,
      factor=(cfg.d_model / cfg.q_lora_rank) ** 0.5,
      **dtypes,
    )
    self.kv_a_layernorm = _ScaledRMSNorm(
      cfg.kv_lora_rank, attention.LATENT_EPS, jnp.dtype(cfg.param_dtype), factor=(cfg.d_model / cfg.kv_lora_rank) ** 0.5
    )


class ShortcutMoELayer(nnx.Module):
  """One ScMoE layer (module docstring): x [B, S, d] -> (x, aux), or with a cache (c1, c2, start) -> (x, aux,
  (c1, c2)), c1 and c2 holding the two attentions' caches on axis 2. `is_moe` must be True (every LongCat layer
  has its MoE branch)."""

  def __init__(self, cfg, moe_cfg, mesh, layer: int, is_moe: bool, *, rngs: nnx.Rngs):
    from moejax.models.decoder import GatedMLP  # the decoder imports this module

    assert is_moe, "every ScMoE layer has its MoE branch (the family's moe_layers)"
    self.ln_attn = nnx.List([block_norm(cfg, cfg.d_model) for _ in range(SUBLAYERS)])
    self.attn = nnx.List([LoraScaledMLA(cfg, layer, rngs=rngs) for _ in range(SUBLAYERS)])
    self.ln_ffn = nnx.List([block_norm(cfg, cfg.d_model) for _ in range(SUBLAYERS)])
    self.mlps = nnx.List([GatedMLP(cfg, cfg.d_ff, rngs=rngs) for _ in range(SUBLAYERS)])
    self.ffn = MoEFFN(moe_cfg, mesh, rngs=rngs, param_dtype=jnp.dtype(cfg.param_dtype))

  def attend(self, x_BxSxD, *, train: bool = False, rngs: nnx.Rngs | None = None, cache=None):
    """The half before the MoE branch: the first attention with its residual, x -> x1; with a cache (c1, c2, start),
    both attentions' on axis 2, (x1, the first attention's new pair)."""
    del train, rngs
    if cache is None:
      return x_BxSxD + self.attn[0](self.ln_attn[0](x_BxSxD))
    out, pair = self.attn[0](self.ln_attn[0](x_BxSxD), cache=(cache[0][:, :, 0], cache[1][:, :, 0], cache[2]))
    return x_BxSxD + out, pair

  def ffn_input(self, x1_BxSxD):
    """The MoE branch's input: the first attention's output normed."""
    return self.ln_ffn[0](x1_BxSxD)

  def after_experts(self, x1_BxSxD, y_BxSxD, cache=None):
    """The half after the MoE branch (ExFlow's: where the row then is): the first dense FFN, the second attention
    (cache: (c1, c2, start) as `attend`'s) and FFN, plus the MoE branch's output y -> (y', the second attention's
    new pair, or None without a cache)."""
    h_BxSxD = self.ln_ffn[0](x1_BxSxD)
    x_BxSxD = x1_BxSxD + self.mlps[0](h_BxSxD, train=False, rng=None)[0]
    if cache is None:
      out, pair = self.attn[1](self.ln_attn[1](x_BxSxD)), None
    else:
      out, pair = self.attn[1](self.ln_attn[1](x_BxSxD), cache=(cache[0][:, :, 1], cache[1][:, :, 1], cache[2]))
    x_BxSxD = x_BxSxD + out
    x_BxSxD = x_BxSxD + self.mlps[1](self.ln_ffn[1](x_BxSxD), train=False, rng=None)[0]
    return x_BxSxD + y_BxSxD.astype(x_BxSxD.dtype), pair

  def __call__(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None, token_ids=None):
    rng = rngs.jitter() if train and rngs is not None else None
    out = self.attend(x_BxSxD, cache=cache)
    x1_BxSxD, first = (out, None) if cache is None else out
    shortcut_BxSxD, aux = self.ffn(self.ffn_input(x1_BxSxD), train=train, rng=rng, token_ids=token_ids)
    x_BxSxD, second = self.after_experts(x1_BxSxD, shortcut_BxSxD, cache)
    if cache is None:
      return x_BxSxD, aux
    return x_BxSxD, aux, tuple(jnp.stack([first[i], second[i]], axis=2) for i in range(2))


def cache_specs(cfg, batch: int, length: int) -> tuple:
  """((shape, dtype), (shape, dtype)) of one ScMoE layer's cache: MLA's latent and rotary key of both attentions,
  [B, S, 2, kv_lora_rank] and [B, S, 2, qk_rope_head_dim]."""
  shapes = attention.cache_shapes(cfg, batch, length)
  return tuple(((*shape[:2], SUBLAYERS, *shape[2:]), cfg.dtype) for shape in shapes)
