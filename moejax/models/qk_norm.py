"""The QK-norm modes of grouped-query attention, one object each (`MODES`): the RMSNorm of q and k that a family
applies, what its weights are and where in the attention it acts. `DecoderConfig.qk_norm_mode` is one of their
names; the attention (`moejax.models.projections`, `attention`), the memory planner (`moejax.study.memory`) and the
decoder step's FLOPs (`moejax.bench.gpu.decoder_step`) ask the mode of a config (`of`), never its name.

  head             each head's q and k before RoPE, weights [head_dim] each (Qwen3, GLM-4.5, dots1, Sarvam)
  projection       all of q's heads at once and all of k's, before the split into heads and before RoPE, weights
                   [num_heads x head_dim] and [num_kv_heads x head_dim] (OLMoE, MiniMax-M2)
  head_after_rope  each head's q and k after RoPE, weights [head_dim] each (HunYuan's query_layernorm and
                   key_layernorm); the keys are cached normed, as transformers caches them
  l2               each head's q and k after RoPE, without weights (Llama 4's L2 norm, in its RoPE layers only)
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.rms_norm import RMSNorm, block_norm

# Where a mode acts on q and k: the flat projections [B, S, heads x W], the heads [B, S, H, W] before RoPE, after it.
ON_PROJECTION, BEFORE_ROPE, AFTER_ROPE = "projection", "before_rope", "after_rope"


@dataclasses.dataclass(frozen=True)
class QkNorm:
  """One mode: its name (a `DecoderConfig.qk_norm_mode`), where it acts (ON_PROJECTION, BEFORE_ROPE, AFTER_ROPE)
  and whether one weight spans the whole projection (else each head's width)."""

  name: str
  where: str
  whole_projection: bool = False
  weighted: bool = True

  def shapes(self, cfg) -> tuple[tuple[int], ...]:
    """(q_norm's weight shape, k_norm's) of a GQA decoder config; () without weights."""
    if not self.weighted:
      return ()
    if self.whole_projection:
      return (cfg.num_heads * cfg.head_dim,), (cfg.num_kv_heads * cfg.head_dim,)
    return (cfg.head_dim,), (cfg.head_dim,)

  def count(self, cfg) -> int:
    """Parameters of one layer's q and k norms."""
    return sum(shape[0] for shape in self.shapes(cfg))

  def norms(self, cfg) -> tuple[RMSNorm, RMSNorm]:
    """(q_norm, k_norm), the modules of one attention layer."""
    if not self.weighted:
      return UnitNorm(cfg.rms_eps), UnitNorm(cfg.rms_eps)
    return tuple(block_norm(cfg, shape[0]) for shape in self.shapes(cfg))

  def apply(self, where: str, q_norm, k_norm, q, k):
    """(q, k) normed if this mode acts at `where` and the layer has the norms; else unchanged. q, k: [B, S, heads x
    W] on the projection, [B, S, H, W] and [B, S, H_kv, W] per head."""
    if q_norm is None or where != self.where:
      return q, k
    return q_norm(q), k_norm(k)


class UnitNorm(nnx.Module):
  """x [..., W] -> x / sqrt(mean(x^2) + eps), statistics in float32, no weight (Llama4TextL2Norm)."""

  def __init__(self, eps: float):
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)


HEAD = QkNorm("head", BEFORE_ROPE)
PROJECTION = QkNorm("projection", ON_PROJECTION, whole_projection=True)
HEAD_AFTER_ROPE = QkNorm("head_after_rope", AFTER_ROPE)
L2 = QkNorm("l2", AFTER_ROPE, weighted=False)
MODES = {mode.name: mode for mode in (HEAD, PROJECTION, HEAD_AFTER_ROPE, L2)}
NAMES = tuple(MODES)  # `DecoderConfig.qk_norm_mode`'s allowed values


def of(cfg) -> QkNorm:
  """The mode of a decoder config (its qk_norm_mode, checked in `DecoderConfig`)."""
  return MODES[cfg.qk_norm_mode]
