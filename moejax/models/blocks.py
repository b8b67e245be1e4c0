"""The Transformer blocks of the language models: attention (with a KV cache for decoding), the dense and the
expert-parallel MoE FFN, the block that joins them (post-LN for 'bert', pre-LN for 'gpt'), and the loop over a
model's blocks with its MoE layers' aux (`run_blocks`, shared with the decoder families)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from moejax.kernels.activations import ACTIVATIONS
from moejax.models import grad_sync as grad_sync_lib
from moejax.models.config import ModelConfig
from moejax.models.sharding import activation_spec, model_param_specs
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.module import MoELayer
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
    logits_BxHxSxS = jnp.einsum("bqhk,bshk->bhqs", q_BxSxHxW, keys_BxSxHxW.astype(q_BxSxHxW.dtype),
                                preferred_element_type=jnp.float32) / jnp.sqrt(d // h)
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

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    del train, rng
    return self.w_out(ACTIVATIONS[self.activation](self.w_in(x_BxSxD))), {}


class MoEFFN(nnx.Module):
  """The expert-parallel MoE layer as an FFN: x [B, L, d] (batch sharded over the mesh) -> (y, aux).

  Calls the layer with the step's key, so router jitter draws from it. aux also holds the layer's
  traffic_rows and expert_ids [B * L, K] (each token's routed experts, from the layer's aux); under jit
  they cost nothing unless used.
  """

  def __init__(self, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.moe = MoELayer(moe_cfg, mesh, rngs=nnx.Rngs(params=rngs.params()), dtype=param_dtype)

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    y_BxSxD, aux = self.moe(x_BxSxD, train=train, rng=rng)
    return y_BxSxD, {k: aux[k] for k in ("aux_loss", "expert_counts", "tokens_dropped", "tokens_overflowed",
                                         "traffic_rows", "expert_ids", "balance_counts") if k in aux}


class Block(nnx.Module):
  """One Transformer block; post-LN for 'bert', pre-LN for 'gpt'. x [B, S, d] -> (x, aux)."""

  def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, mesh, moe: bool, *, rngs: nnx.Rngs):
    self.pre_ln = cfg.kind == "gpt"
    epsilon = 1e-5 if self.pre_ln else 1e-12  # GPT-2's, BERT's
    self.attn = Attention(cfg, rngs=rngs)
    self.ln_attn = nnx.LayerNorm(cfg.d_model, epsilon=epsilon, rngs=rngs)
    self.ffn = MoEFFN(moe_cfg, mesh, rngs=rngs) if moe else DenseFFN(cfg, moe_cfg.activation, rngs=rngs)
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

  def feed_forward(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None):
    """The FFN half with its residual (and LayerNorm) -> (x, aux)."""
    drop = lambda y: self.dropout(y, deterministic=not train, rngs=rngs)
    ffn_rng = rngs.jitter() if train and rngs is not None else None
    if self.pre_ln:
      y_BxSxD, aux = self.ffn(self.ln_ffn(x_BxSxD), train=train, rng=ffn_rng)
      return x_BxSxD + drop(y_BxSxD), aux
    y_BxSxD, aux = self.ffn(x_BxSxD, train=train, rng=ffn_rng)
    return self.ln_ffn(x_BxSxD + drop(y_BxSxD)), aux

  def __call__(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None):
    """x -> (x, aux); with a KV cache (`Attention`), (x, aux, cache)."""
    if cache is None:
      return self.feed_forward(self.attend(x_BxSxD, train=train, rngs=rngs), train=train, rngs=rngs)
    x_BxSxD, cache = self.attend(x_BxSxD, train=train, rngs=rngs, cache=cache)
    return *self.feed_forward(x_BxSxD, train=train, rngs=rngs), cache



REMAT_POLICIES = {"full": None, "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "save_exchanged": jax.checkpoint_policies.save_only_these_names(path_lib.EXCHANGED)}


def _remat(remat: str):
  """A training block call (block, x, rngs) -> (x, aux) whose backward recomputes what `remat` does not keep."""
  return nnx.remat(lambda block, x, rngs: block(x, train=True, rngs=rngs), policy=REMAT_POLICIES[remat])


def run_blocks(model, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None, start=0, details: bool = False):
  """x [B, S, d] through `model.blocks` (each x -> (x, aux), or with a cache (x, aux, cache)), the activations
  kept sharded as `activation_spec` says, each block's gradients reduced before the block below's with
  grad_sync='prioritized', each training block rematerialised as cfg.remat says -> (x, aux, the new cache or []).

  aux: aux_loss (the MoE layers' summed), expert_counts [M, E], tokens_dropped [M], tokens_overflowed [M] (and
  balance_counts [M, ...] with balance_loss='global_batch'; with details, expert_ids [M, B * S, K] and traffic_rows
  [M, hops, A, A]) for the M MoE layers in order."""
  cfg, moe_cfg = model.cfg, model.moe_cfg
  dtype = jnp.dtype(cfg.dtype)
  batch_sharding = NamedSharding(model.mesh, activation_spec(cfg))
  constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
  x_BxSxD = constrain(x_BxSxD)
  auxes, new_cache = [], []
  for i, block in enumerate(model.blocks):
    if cfg.grad_sync == "prioritized":
      specs = model_param_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), cfg, moe_cfg, model.mesh)
      x_BxSxD = grad_sync_lib.reduce_before_passing_on(block, x_BxSxD, model.mesh, specs)
    if cache is None and train and cfg.remat != "none":
      x_BxSxD, aux = _remat(cfg.remat)(block, x_BxSxD, rngs)
    elif cache is None:
      x_BxSxD, aux = block(x_BxSxD, train=train, rngs=rngs)
    else:
      x_BxSxD, aux, layer_cache = block(x_BxSxD, train=train, rngs=rngs, cache=(*cache[i], start))
      new_cache.append(layer_cache)
    x_BxSxD = constrain(x_BxSxD.astype(dtype))
    if aux:
      auxes.append(aux)
  stack = lambda name: jnp.stack([a[name] for a in auxes])
  aux = {
      "aux_loss": sum((a["aux_loss"] for a in auxes), jnp.zeros((), jnp.float32)),
      "expert_counts": stack("expert_counts") if auxes else jnp.zeros((0, moe_cfg.num_experts), jnp.int32),
      **{name: stack(name) if auxes else jnp.zeros((0,), jnp.int32) for name in ("tokens_dropped", "tokens_overflowed")},
  }
  if auxes and "balance_counts" in auxes[0]:  # balance_loss='global_batch': the next micro-batch's input
    aux["balance_counts"] = stack("balance_counts")
  if details and auxes:
    aux.update({name: stack(name) for name in ("expert_ids", "traffic_rows")})
  return x_BxSxD, aux, new_cache
