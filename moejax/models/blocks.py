"""SMILE's Transformer blocks: attention (with a KV cache for decoding), the dense FFN, and the block that joins
it or the MoE FFN (`backbone.MoEFFN`, re-exported here) with attention, post-LN for 'bert', pre-LN for 'gpt'. The
loop over a model's blocks is `backbone.run_blocks`."""

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.activations import ACTIVATIONS
from moejax.models.backbone import Halves, MoEFFN
from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.validation import require


class Attention(nnx.Module):
  """Multi-head self-attention, softmax in fp32: x [B, S, d] -> [B, S, d].

  With a KV cache (k, v [B, S_cache, H, W], start): x [B, S, d] holds positions start .. start + S - 1
  of every sequence; their keys and values are written into the cache there, each query attends to
  the cache positions up to its own, and the call returns (out, (k, v)) with the updated cache.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_heads, self.causal = cfg.num_heads, cfg.kind == "gpt"
    width = cfg.d_model // cfg.num_heads
    # Heads are an axis of the kernels, so tensor parallelism can split them (`param_specs`).
    self.qkv = nnx.LinearGeneral(cfg.d_model, (3, cfg.num_heads, width), dtype=dtype, rngs=rngs)
    self.out = nnx.LinearGeneral((cfg.num_heads, width), cfg.d_model, axis=(-2, -1), dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rngs: nnx.Rngs | None, cache=None):
    s, d = x_BxSxD.shape[1:]
    h = self.num_heads
    qkv_BxSx3xHxW = self.qkv(x_BxSxD)
    q_BxSxHxW, k_BxSxHxW, v_BxSxHxW = (qkv_BxSx3xHxW[:, :, i] for i in range(3))
    if cache is None:
      keys_BxSxHxW, values_BxSxHxW = k_BxSxHxW, v_BxSxHxW
      visible_SxS = jnp.tril(jnp.ones((s, s), bool)) if self.causal else None
    else:
      k_cache, v_cache, start = cache
      write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1)
      keys_BxSxHxW, values_BxSxHxW = write(k_cache, k_BxSxHxW), write(v_cache, v_BxSxHxW)
      # Causal over the cache; positions not written yet lie after every query, so stay hidden too.
      visible_SxS = (start + jnp.arange(s))[:, None] >= jnp.arange(k_cache.shape[1])[None, :]
    logits_BxHxSxS = jnp.einsum(
      "bqhk,bshk->bhqs", q_BxSxHxW, keys_BxSxHxW.astype(q_BxSxHxW.dtype), preferred_element_type=jnp.float32
    ) / jnp.sqrt(d // h)
    if visible_SxS is not None:
      logits_BxHxSxS = jnp.where(visible_SxS, logits_BxHxSxS, -1e9)
    probs_BxHxSxS = jax.nn.softmax(logits_BxHxSxS, axis=-1).astype(x_BxSxD.dtype)
    probs_BxHxSxS = self.dropout(probs_BxHxSxS, deterministic=not train, rngs=rngs)
    out_BxSxHxW = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxSxS, values_BxSxHxW.astype(x_BxSxD.dtype))
    out_BxSxD = self.out(out_BxSxHxW)
    return out_BxSxD if cache is None else (out_BxSxD, (keys_BxSxHxW, values_BxSxHxW))


class DenseFFN(nnx.Module):
  """x [B, S, d] -> act(x @ w_in) @ w_out; returns (y, {}) like the MoE FFN."""

  def __init__(self, cfg: ModelConfig, activation: str, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.activation = activation
    self.w_in = nnx.Linear(cfg.d_model, cfg.d_ff, dtype=dtype, rngs=rngs)
    self.w_out = nnx.Linear(cfg.d_ff, cfg.d_model, dtype=dtype, rngs=rngs)

  def __call__(
    self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None, token_ids=None
  ) -> tuple[jax.Array, dict]:
    del train, rng, token_ids  # a dense FFN routes nothing
    return self.w_out(ACTIVATIONS[self.activation](self.w_in(x_BxSxD))), {}


class Block(Halves):
  """One Transformer block; post-LN for 'bert', pre-LN for 'gpt'. x [B, S, d] -> (x, aux), with a KV cache
  (`Attention`) (x, aux, cache). is_moe: the FFN is the
  MoE layer (`MoEFFN`), else `DenseFFN`."""

  def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, mesh, is_moe: bool, *, rngs: nnx.Rngs):
    self.pre_ln = cfg.kind == "gpt"
    epsilon = 1e-5 if self.pre_ln else 1e-12  # GPT-2's, BERT's
    self.attn = Attention(cfg, rngs=rngs)
    self.ln_attn = nnx.LayerNorm(cfg.d_model, epsilon=epsilon, rngs=rngs)
    self.ffn = MoEFFN(moe_cfg, mesh, rngs=rngs) if is_moe else DenseFFN(cfg, moe_cfg.activation, rngs=rngs)
    self.ln_ffn = nnx.LayerNorm(cfg.d_model, epsilon=epsilon, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def attend(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None):
    """The attention half with its residual (and LayerNorm); with a cache (pre-LN only), (x, cache)."""
    drop = lambda y: self.dropout(y, deterministic=not train, rngs=rngs)
    if not self.pre_ln:
      require(cache is None, "kind", "bert", "'gpt' for a KV cache (a causal decoder)")
      return self.ln_attn(x_BxSxD + drop(self.attn(x_BxSxD, train=train, rngs=rngs)))
    out = self.attn(self.ln_attn(x_BxSxD), train=train, rngs=rngs, cache=cache)
    if cache is None:
      return x_BxSxD + drop(out)
    return x_BxSxD + drop(out[0]), out[1]

  def ffn_input(self, x_BxSxD):
    """What the FFN takes of the residual stream x: x normed (pre-LN) or x itself (post-LN)."""
    return self.ln_ffn(x_BxSxD) if self.pre_ln else x_BxSxD

  def ffn_output(self, y_BxSxD):
    """What a pre-LN block adds to the residual stream of its FFN's output y: y (ExFlow's decode, which sums the
    experts' outputs itself, runs pre-LN blocks only: post-LN has no KV cache)."""
    require(self.pre_ln, "kind", "bert", "'gpt' (a post-LN block norms the residual sum, not the FFN's output)")
    return y_BxSxD

  def after_experts(self, x_BxSxD, y_BxSxD, cache=None):
    """ExFlow's half after the MoE layer: x plus the experts' output y (`ffn_output`) -> (x, None: no cache)."""
    del cache
    return x_BxSxD + self.ffn_output(y_BxSxD.astype(x_BxSxD.dtype)), None

  def feed_forward(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, token_ids=None):
    """The FFN half with its residual (and LayerNorm) -> (x, aux). token_ids [B, S]: what routing='hash' routes by."""
    drop = lambda y: self.dropout(y, deterministic=not train, rngs=rngs)
    ffn_rng = rngs.jitter() if train and rngs is not None else None
    if self.pre_ln:
      y_BxSxD, aux = self.ffn(self.ln_ffn(x_BxSxD), train=train, rng=ffn_rng, token_ids=token_ids)
      return x_BxSxD + drop(y_BxSxD), aux
    y_BxSxD, aux = self.ffn(x_BxSxD, train=train, rng=ffn_rng, token_ids=token_ids)
    return self.ln_ffn(x_BxSxD + drop(y_BxSxD)), aux
