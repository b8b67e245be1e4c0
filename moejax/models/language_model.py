"""The SMILE language models: a BERT-like encoder and a GPT-style causal decoder with MoE blocks.

Both stack `num_layers` Transformer blocks in which every `moe_every`-th FFN is an expert-parallel
MoE layer (`moejax.moe.layer`; routing, transport and expert backend come from the MoE config). The
encoder is post-LN as in BERT and SMILE (attention -> residual -> LayerNorm, FFN -> residual ->
LayerNorm) with a BERT MLM head; the decoder is pre-LN as in GPT-2. Both tie their output layer to
the token embeddings. Parameters are fp32; `dtype` is the compute dtype of the matmuls.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.activations import ACTIVATIONS
from moejax.models import backbone
from moejax.models import layers as layers_lib
from moejax.models.blocks import Block
from moejax.models.config import ModelConfig
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError


class LanguageModel(layers_lib.LayerViews, nnx.Module):
  """tokens [B, S] int32 (B sharded over both mesh axes) -> (logits [B, S, V] fp32, aux); with
  positions [B, P], logits [B, P, V] at those positions only.

  aux: aux_loss (sum over the MoE layers of their auxiliary losses, SMILE Eq. 5), expert_counts
  [M, E], tokens_dropped [M] and tokens_overflowed [M] for the M MoE layers in order.
  """

  def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    if (moe_cfg.d_model, moe_cfg.d_ff) != (cfg.d_model, cfg.d_ff):
      raise ConfigError(
        f"MoE widths ({moe_cfg.d_model}, {moe_cfg.d_ff}) differ from the model's d_model={cfg.d_model}, d_ff={cfg.d_ff}"
      )
    self.cfg, self.moe_cfg, self.mesh = cfg, moe_cfg, mesh
    embed_init = nnx.initializers.normal(cfg.embed_init_std)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init, rngs=rngs)
    self.pos_embed = nnx.Param(embed_init(rngs.params(), (cfg.max_len, cfg.d_model)))
    if cfg.kind == "bert":  # BERT's embedding LayerNorm
      self.embed_ln = nnx.LayerNorm(cfg.d_model, epsilon=1e-12, rngs=rngs)
    self.embed_dropout = nnx.Dropout(cfg.dropout)
    layers = [Block(cfg, moe_cfg, mesh, cfg.is_moe(i), rngs=rngs) for i in range(cfg.num_layers)]
    if cfg.scan_layers:  # the same values, stacked per segment (`moejax.models.layers`)
      self.segments = layers_lib.stacked(layers, cfg)
    else:
      self.blocks = nnx.List(layers)
    if cfg.kind == "bert":  # BERT's MLM transform before the tied decoder
      self.head = nnx.Linear(cfg.d_model, cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
    self.head_ln = nnx.LayerNorm(cfg.d_model, epsilon=1e-12, rngs=rngs)
    self.head_bias = nnx.Param(jnp.zeros((cfg.vocab_size,)))

  def embed_tokens(
    self, tokens_BxS: jax.Array, start=0, *, train: bool = False, rngs: nnx.Rngs | None = None
  ) -> jax.Array:
    """tokens [B, S] at positions start .. start + S - 1 -> x [B, S, d] in the compute dtype."""
    x_BxSxD = self.embed(tokens_BxS) + jax.lax.dynamic_slice_in_dim(self.pos_embed[...], start, tokens_BxS.shape[1])
    if self.cfg.kind == "bert":
      x_BxSxD = self.embed_ln(x_BxSxD)
    return self.embed_dropout(x_BxSxD, deterministic=not train, rngs=rngs).astype(jnp.dtype(self.cfg.dtype))

  def head_features(self, x_BxSxD: jax.Array) -> jax.Array:
    """x [..., d] after the last block -> the output layer's input h [..., d] in the compute dtype (BERT's MLM
    transform, then the head's LayerNorm)."""
    if self.cfg.kind == "bert":
      x_BxSxD = ACTIVATIONS[self.moe_cfg.activation](self.head(x_BxSxD))
    return self.head_ln(x_BxSxD).astype(jnp.dtype(self.cfg.dtype))

  def output_layer(self) -> tuple[jax.Array, jax.Array]:
    """(kernel [d, V]: the tied token embeddings, transposed, in the compute dtype; bias [V] fp32)."""
    return self.embed.embedding[...].T.astype(jnp.dtype(self.cfg.dtype)), self.head_bias[...]

  def head_logits(self, x_BxSxD: jax.Array) -> jax.Array:
    """x [..., d] after the last block -> logits [..., V] fp32 (tied output layer)."""
    kernel_DxV, bias_V = self.output_layer()
    return (
      jnp.einsum("...d,dv->...v", self.head_features(x_BxSxD), kernel_DxV, preferred_element_type=jnp.float32) + bias_V
    )

  def __call__(
    self,
    tokens_BxS: jax.Array,
    *,
    positions_BxP: jax.Array | None = None,
    train: bool = False,
    rngs: nnx.Rngs | None = None,
    cache=None,
    start=0,
    details: bool = False,
    features: bool = False,
  ):
    """-> (logits, aux), or (logits, aux, cache) with a KV cache.

    cache: a (k, v) [B, S_cache, H, W] pair per block, stacked per segment when scanned (`moejax.infer.cache`; 'gpt'
    only): tokens are at
    positions start .. start + S - 1 and the returned cache holds their keys and values.
    details: aux also holds expert_ids [M, B * S, K] and traffic_rows [M, hops, A, A] per MoE layer.
    features: the output layer's inputs h [B, S or P, d] (`head_features`) in place of the logits: the loss applies
    `output_layer` to them (`moejax.train.objective.model_loss_sums`, chunk by chunk).
    """
    x_BxSxD = self.embed_tokens(tokens_BxS, start, train=train, rngs=rngs)
    x_BxSxD, aux, new_cache = backbone.run_blocks(
      self, x_BxSxD, train=train, rngs=rngs, cache=cache, start=start, details=details, token_ids=tokens_BxS
    )
    if positions_BxP is not None:
      x_BxSxD = jnp.take_along_axis(x_BxSxD, positions_BxP[..., None], axis=1)
    out = (self.head_features if features else self.head_logits)(x_BxSxD)
    return (out, aux) if cache is None else (out, aux, new_cache)
