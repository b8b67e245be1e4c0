"""DeepSeek-V4's decoder layer, a block kind of the decoder (`Family.block` 'hyper_connected'; the usual pre-norm
block is 'sequential', `decoder.DecoderLayer`): the residual is N = hc_mult streams, and each sublayer is wrapped in
manifold-constrained hyper-connections (mHC, `moejax.models.mixers.hyper_connections`):

  streams = merge(attn_hc: post, comb; attn(ln_attn(collapse(streams))))
  streams = merge(ffn_hc: post, comb; ffn(ln_ffn(collapse(streams))))

as transformers' DeepseekV4DecoderLayer. Between layers the streams travel flattened, x [B, S, N D] (stream k at
columns k D .. (k + 1) D - 1), so that the loop over the layers (`backbone.run_blocks`: sharding constraints over
batch and sequence, casts, scans) carries one [B, S, width] array as for every block; the decoder expands the
embeddings to N copies (`expand`) and collapses the streams with the hyper head before its final norm (`HyperHead`).
The layer's parameters are named as the checkpoint's (`attn_hc/fn` -> `attn_hc.fn`, published `hc_attn_fn`).
An MoE layer that `DecoderConfig.hash_layers` marks routes by the token id table (`layer_moe_config`).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import families, token_mixers
from moejax.models.backbone import Halves, MoEFFN
from moejax.models.deepseek_v4_mixer import Tensors, hf_fields
from moejax.models.mixers import hyper_connections as hc
from moejax.models.rms_norm import block_norm

HYPER = "hyper_connected"


def uses(cfg) -> bool:
  """Whether a model config's layers are mHC layers (its family's `block`); SMILE's configs never."""
  family = getattr(cfg, "family", None)
  return family in families.REGISTRY and families.get(family).block == HYPER


def hyper_config(cfg) -> hc.HyperConnectionConfig:
  """The mHC config (streams, Sinkhorn iterations, eps) of a decoder config's config.json fields."""
  return hc.HyperConnectionConfig.from_hf(hf_fields(cfg))


def layer_moe_config(cfg, moe_cfg, layer: int):
  """The MoE layer config of layer `layer`: moe_cfg, or in a hash layer (`hash_layers`) routing 'hash' by a table
  over the vocabulary (DeepSeek-V4's tid2eid), without the balancing bias (the table chooses, not the scores)."""
  if not (cfg.hash_layers and cfg.hash_layers[layer]):
    return moe_cfg
  return dataclasses.replace(moe_cfg, routing="hash", hash_vocab=cfg.vocab_size, bias_update_rate=0.0)


def expand(x_BxSxD: jax.Array, n: int) -> jax.Array:
  """The first layer's input: the embeddings x [B, S, D] as N identical streams, flattened [B, S, N D]."""
  return jnp.tile(x_BxSxD, (1, 1, n))


def _streams(x_BxSxND: jax.Array, n: int) -> jax.Array:
  b, s, width = x_BxSxND.shape
  return x_BxSxND.reshape(b, s, n, width // n)


def _mhc_tensors(config: hc.HyperConnectionConfig, d: int, rngs: nnx.Rngs) -> Tensors:
  """One mHC module's fn [(2 + N) N, N D], base [(2 + N) N], scale [3], float32 (as transformers keeps them)."""
  n = config.hc_mult
  return Tensors({"fn": (config.num_weights, n * d), "base": (config.num_weights,), "scale": (3,)}, rngs=rngs)


class HyperConnectedLayer(Halves):
  """One mHC layer (module docstring): x [B, S, N D] -> (x, aux), or with a cache (*arrays, start) (x, aux, arrays),
  in `Halves` (ExFlow's decode runs them apart). is_moe: the FFN is the MoE layer (`MoEFFN`, with
  `layer_moe_config`), else the dense SwiGLU."""

  def __init__(self, cfg, moe_cfg, mesh, layer: int, is_moe: bool, *, rngs: nnx.Rngs):
    from moejax.models.decoder import GatedMLP  # the decoder imports this module

    self.hc = hyper_config(cfg)
    pd = jnp.dtype(cfg.param_dtype)
    self.ln_attn = block_norm(cfg, cfg.d_model)
    self.attn = token_mixers.of(cfg, layer).build(cfg, layer, rngs=rngs)
    self.ln_ffn = block_norm(cfg, cfg.d_model)
    moe_layer = layer_moe_config(cfg, moe_cfg, layer)
    self.ffn = MoEFFN(moe_layer, mesh, rngs=rngs, param_dtype=pd) if is_moe else GatedMLP(cfg, cfg.d_ff, rngs=rngs)
    self.attn_hc = _mhc_tensors(self.hc, cfg.d_model, rngs)
    self.ffn_hc = _mhc_tensors(self.hc, cfg.d_model, rngs)

  def attend(self, x_BxSxND, *, train: bool, rngs: nnx.Rngs | None, cache=None):
    """The attention's hyper-connected half: streams -> streams; with a cache (*arrays, start), (streams, arrays)."""
    del train, rngs
    streams = _streams(x_BxSxND, self.hc.hc_mult)
    _, post, comb, collapsed = hc.mixing_weights(self.attn_hc.tensors(), streams, self.hc)
    out = self.attn(self.ln_attn(collapsed), cache=cache)
    y_BxSxD, new_cache = (out, None) if cache is None else out
    x_BxSxND = hc.merge(post, comb, y_BxSxD, streams).reshape(x_BxSxND.shape)
    return x_BxSxND if cache is None else (x_BxSxND, new_cache)

  def ffn_input(self, x_BxSxND):
    """What the FFN takes of the streams: the normed collapse by the FFN's mHC weights, [B, S, N D] -> [B, S, D]
    (rows [R, N D] -> [R, D]: ExFlow's hop)."""
    if x_BxSxND.ndim == 2:
      return self.ffn_input(x_BxSxND[:, None])[:, 0]
    return self.ln_ffn(hc.mixing_weights(self.ffn_hc.tensors(), _streams(x_BxSxND, self.hc.hc_mult), self.hc)[3])

  def after_experts(self, x_BxSxND, y_BxSxD, cache=None):
    """The streams merged with the FFN's output y by the FFN's mHC weights (of the streams x, as `ffn_input` read
    them) -> (streams, None: no cache)."""
    del cache
    if x_BxSxND.ndim == 2:  # rows (ExFlow's hop)
      return self.after_experts(x_BxSxND[:, None], y_BxSxD[:, None])[0][:, 0], None
    streams = _streams(x_BxSxND, self.hc.hc_mult)
    _, post, comb, _ = hc.mixing_weights(self.ffn_hc.tensors(), streams, self.hc)
    return hc.merge(post, comb, y_BxSxD.astype(streams.dtype), streams).reshape(x_BxSxND.shape), None


class HyperHead(Tensors):
  """The streams' last collapse before the final norm (transformers' DeepseekV4HyperHead): x [B, S, N D] ->
  [B, S, D] (rows [R, N D] -> [R, D]); hc_fn [N, N D], hc_base [N], hc_scale [1] (float32)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    config = hyper_config(cfg)
    n, d = config.hc_mult, cfg.d_model
    super().__init__({"hc_fn": (n, n * d), "hc_base": (n,), "hc_scale": (1,)}, rngs=rngs)
    self.hc = config

  def __call__(self, x_BxSxND: jax.Array) -> jax.Array:
    if x_BxSxND.ndim == 2:  # rows [R, N D] (ExFlow's decode)
      return self(x_BxSxND[:, None])[:, 0]
    return hc.hyper_head(self.tensors(), _streams(x_BxSxND, self.hc.hc_mult), self.hc)
