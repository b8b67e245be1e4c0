"""`Decoder`: the decoder families of today's MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) and their
dense sources, pre-norm blocks of RMSNorm, a token mixer (`moejax.models.token_mixers`: attention,
`moejax.models.attention`, or Qwen3-Next's gated DeltaNet), RMSNorm and an FFN that is the
SwiGLU MLP or moejax's one MoE layer (routing as the checkpoint's, with every transport, schedule, expert sharding,
replica and placement choice of `MoEConfig`), and DeepSeek-V3's multi-token prediction (MTP) modules.

It keeps the interface of the SMILE models (`moejax.models.language_model`), so training and inference (the KV
cache, ExFlow's decode) take either: `embed_tokens`, the layers (`blocks`, or scanned `segments`: `moejax.models.layers`;
each block with `attend`, `feed_forward`, `ln_ffn`, `ffn`), `head_logits`, and the call.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import backbone, hyper_block, shortcut_block, sparse_attention, token_mixers
from moejax.models import layers as layers_lib
from moejax.models.backbone import MoEFFN
from moejax.models.decoder_config import DecoderConfig
from moejax.models.projections import linear
from moejax.models.rms_norm import RMSNorm, block_norm
from moejax.models.sparse_attention import Stream
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError


class GatedMLP(nnx.Module):
  """The dense SwiGLU FFN: x [B, S, d] -> down(silu(gate(x)) * up(x)); returns (y, {}) like the MoE FFN."""

  def __init__(self, cfg: DecoderConfig, width: int, *, rngs: nnx.Rngs):
    self.gate_proj = linear(cfg, cfg.d_model, width, False, rngs)
    self.up_proj = linear(cfg, cfg.d_model, width, False, rngs)
    self.down_proj = linear(cfg, width, cfg.d_model, False, rngs)

  def __call__(
    self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None, token_ids=None
  ) -> tuple[jax.Array, dict]:
    del train, rng, token_ids  # a dense FFN routes nothing
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BxSxD)) * self.up_proj(x_BxSxD)), {}


class DecoderLayer(backbone.Halves):
  """x -> x + attn(ln_attn(x)); x -> x + ffn(ln_ffn(x)); x [B, S, d] -> (x, aux), or with a cache (x, aux, cache).
  With cfg.post_norm (OLMo 2's blocks) each sublayer's output is normed instead: x -> x + ln_attn(attn(x)), x -> x +
  ln_ffn(ffn(x)). attn: the layer's token mixer (`moejax.models.token_mixers`: attention, or Qwen3-Next's gated
  DeltaNet), one interface (x, cache) -> y or (y, cache). is_moe: the FFN is the MoE layer (`MoEFFN`), else the dense
  `GatedMLP`."""

  def __init__(self, cfg: DecoderConfig, moe_cfg: MoEConfig, mesh, layer: int, is_moe: bool, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.post_norm, self.residual_multiplier = cfg.post_norm, cfg.residual_multiplier
    self.ln_attn = block_norm(cfg, cfg.d_model)
    self.attn = token_mixers.of(cfg, layer).build(cfg, layer, rngs=rngs)  # attention or another token mixer
    self.ln_ffn = block_norm(cfg, cfg.d_model)
    self.ffn = MoEFFN(moe_cfg, mesh, rngs=rngs, param_dtype=pd) if is_moe else GatedMLP(cfg, cfg.d_ff, rngs=rngs)

  def attend(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None):
    """The attention half with its residual; with a cache (c1, c2, start), (x, (c1, c2)). x may be a `Stream` (a
    model with 'dsa_shared' layers): the mixer takes it, and the choice it returns is passed on."""
    del train, rngs
    out = self.attn(x_BxSxD if self.post_norm else sparse_attention.apply_x(self.ln_attn, x_BxSxD), cache=cache)
    y, new_cache = (out, None) if cache is None else out
    y_BxSxD = sparse_attention.activations(y)
    added = lambda x: x + self._scaled(self.ln_attn(y_BxSxD) if self.post_norm else y_BxSxD)
    x_BxSxD = Stream(added(x_BxSxD.x), y.topk) if isinstance(y, Stream) else added(x_BxSxD)
    return x_BxSxD if cache is None else (x_BxSxD, new_cache)

  def _scaled(self, y_BxSxD):
    """A sublayer's output as added to the residual stream: times residual_multiplier (Granite's; `mup`)."""
    return y_BxSxD if self.residual_multiplier == 1 else y_BxSxD * self.residual_multiplier

  def ffn_input(self, x_BxSxD):
    """What the FFN takes of the residual stream x: x normed (pre-norm blocks) or x itself (post-norm)."""
    return x_BxSxD if self.post_norm else self.ln_ffn(x_BxSxD)

  def ffn_output(self, y_BxSxD):
    """What the FFN adds to the residual stream of its output y: y, or y normed (post-norm blocks), times
    residual_multiplier."""
    return self._scaled(self.ln_ffn(y_BxSxD) if self.post_norm else y_BxSxD)

  def after_experts(self, x_BxSxD, y_BxSxD, cache=None):
    """The half after the FFN (ExFlow's, after the MoE layer's hops): x plus the FFN's output y (`ffn_output`) ->
    (x, None: no cache)."""
    del cache
    return sparse_attention.apply_x(lambda x: x + self.ffn_output(y_BxSxD.astype(x.dtype)), x_BxSxD), None

  def feed_forward(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, token_ids=None):
    """The FFN half with its residual -> (x, aux); a `Stream`'s choice passed on as it came. token_ids [B, S]: what
    routing='hash' routes by."""
    if isinstance(x_BxSxD, Stream):
      y_BxSxD, aux = self.feed_forward(x_BxSxD.x, train=train, rngs=rngs, token_ids=token_ids)
      return x_BxSxD._replace(x=y_BxSxD), aux
    return super().feed_forward(x_BxSxD, train=train, rngs=rngs, token_ids=token_ids)


class MultiTokenPrediction(nnx.Module):
  """One of DeepSeek-V3's MTP modules (Sec. 2.2): h' = eh_proj([enorm(embed(t_{i+k})); hnorm(h_i)]), then one
  block, then its own RMSNorm before the shared output head. Names as in the checkpoint's layer num_layers + k."""

  def __init__(self, cfg: DecoderConfig, moe_cfg: MoEConfig, mesh, depth: int, *, rngs: nnx.Rngs):
    self.enorm, self.hnorm = block_norm(cfg, cfg.d_model), block_norm(cfg, cfg.d_model)
    self.eh_proj = linear(cfg, 2 * cfg.d_model, cfg.d_model, False, rngs)
    layer = cfg.num_layers + depth
    self.block = DecoderLayer(cfg, moe_cfg, mesh, layer, cfg.num_moe_layers > 0, rngs=rngs)
    self.norm = block_norm(cfg, cfg.d_model)

  def __call__(self, h_BxSxD, embedded_BxSxD, *, train: bool, rngs: nnx.Rngs | None, token_ids=None):
    """token_ids [B, S]: the ids the module embeds (t_{i+k}), which its MoE layer routes by with routing='hash'."""
    x_BxSxD = self.eh_proj(jnp.concatenate([self.enorm(embedded_BxSxD), self.hnorm(h_BxSxD)], axis=-1))
    return self.block(x_BxSxD, train=train, rngs=rngs, token_ids=token_ids)


class Decoder(layers_lib.LayerViews, nnx.Module):
  """tokens [B, S] int32 (B sharded over both mesh axes) -> (logits [B, S, V] fp32, aux); with positions [B, P],
  logits at those positions only. aux as `backbone.run_blocks`; in training with MTP modules, also mtp_logits
  [num_mtp_layers, B, S, V] (module k at position i predicts token i + k + 2; the last k + 1 positions predict
  nothing) and mtp_aux_loss, and the per-layer arrays (expert_counts, ...) have the modules' MoE layers last."""

  def __init__(self, cfg: DecoderConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    if cfg.num_moe_layers and moe_cfg.d_model != cfg.d_model:
      raise ConfigError(f"MoE width d_model={moe_cfg.d_model} differs from the decoder's d_model={cfg.d_model}")
    self.cfg, self.moe_cfg, self.mesh = cfg, moe_cfg, mesh
    pd = jnp.dtype(cfg.param_dtype)
    self.embed = nnx.Embed(
      cfg.vocab_size, cfg.d_model, param_dtype=pd, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
    )
    block = shortcut_block.ShortcutMoELayer if shortcut_block.uses(cfg) else DecoderLayer  # the family's block kind
    block = hyper_block.HyperConnectedLayer if hyper_block.uses(cfg) else block
    layers = [block(cfg, moe_cfg, mesh, i, cfg.is_moe(i), rngs=rngs) for i in range(cfg.num_layers)]
    if cfg.scan_layers:  # the same values, stacked per segment (`moejax.models.layers`)
      self.segments = layers_lib.stacked(layers, cfg)
    else:
      self.blocks = nnx.List(layers)
    self.hc_head = hyper_block.HyperHead(cfg, rngs=rngs) if hyper_block.uses(cfg) else None  # mHC's streams
    self.norm = block_norm(cfg, cfg.d_model)
    self.lm_head = None if cfg.tie_embeddings else linear(cfg, cfg.d_model, cfg.vocab_size, False, rngs)
    self.mtp = nnx.List([MultiTokenPrediction(cfg, moe_cfg, mesh, k, rngs=rngs) for k in range(cfg.num_mtp_layers)])

  def embed_tokens(
    self, tokens_BxS: jax.Array, start=0, *, train: bool = False, rngs: nnx.Rngs | None = None
  ) -> jax.Array:
    """tokens [B, S] -> x [B, S, d] in the compute dtype (positions enter through RoPE, so `start` is unused); with
    mHC its hc_mult streams, flattened [B, S, hc_mult d] (`hyper_block.expand`)."""
    del start, train, rngs
    x_BxSxD = self.embed(tokens_BxS)
    x_BxSxD = x_BxSxD if self.cfg.embedding_multiplier == 1 else x_BxSxD * self.cfg.embedding_multiplier  # Granite's
    x_BxSxD = x_BxSxD if self.hc_head is None else hyper_block.expand(x_BxSxD, self.hc_head.hc.hc_mult)
    return x_BxSxD.astype(jnp.dtype(self.cfg.dtype))

  def head_features(self, x_BxSxD: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
    """x [..., d] after the last block -> the output layer's input h [..., d] in the compute dtype: `norm` (default
    the final RMSNorm) of x, divided by logits_scaling (Granite's: the logits are linear in h)."""
    x_BxSxD = x_BxSxD if self.hc_head is None else self.hc_head(x_BxSxD)  # mHC's streams collapsed
    h_BxSxD = (self.norm if norm is None else norm)(x_BxSxD)
    h_BxSxD = h_BxSxD if self.cfg.logits_scaling == 1 else h_BxSxD / self.cfg.logits_scaling
    return h_BxSxD.astype(jnp.dtype(self.cfg.dtype))

  def output_layer(self) -> tuple[jax.Array, None]:
    """(kernel [d, V] in the compute dtype: lm_head's, or the embeddings' transposed when tied; no bias)."""
    kernel_DxV = self.embed.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return kernel_DxV.astype(jnp.dtype(self.cfg.dtype)), None

  def head_logits(self, x_BxSxD: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
    """x [..., d] after the last block -> logits [..., V] fp32 (after `norm`, default the final RMSNorm)."""
    kernel_DxV, _ = self.output_layer()
    return jnp.einsum(
      "...d,dv->...v", self.head_features(x_BxSxD, norm), kernel_DxV, preferred_element_type=jnp.float32
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
    """-> (logits, aux), or (logits, aux, cache) with a cache: a pair per layer (its token mixer's; scanned,
    stacked per segment: `moejax.infer.cache`), the tokens at positions start .. start + S - 1.
    features: the output layer's inputs h [B, S or P, d] (`head_features`) in place of the logits, and the MTP
    modules' as mtp_features [num_mtp_layers, B, S, d] in place of mtp_logits: the loss applies `output_layer` to them
    (`moejax.train.objective.model_loss_sums`, chunk by chunk).
    Any batch B without a cache: B is sharded over every device, so a B the mesh does not divide runs padded with
    copies of the last row and the outputs are cut back to B rows (aux's sums and per-token arrays cover the padded
    batch; `moejax.infer.generate_tokens` pads its cache's batch the same way). Called outside any transformation
    (a notebook, a test), the forward runs as one compiled program (`_compiled_forward`), not op by op."""
    kw = dict(positions_BxP=positions_BxP, train=train, rngs=rngs, start=start, details=details, features=features)
    if cache is None and isinstance(start, int) and not _traced(tokens_BxS, self.embed.embedding[...]):
      return _compiled_forward(self, tokens_BxS, **kw)
    return self.forward(tokens_BxS, cache=cache, **kw)

  def forward(self, tokens_BxS, *, positions_BxP=None, train=False, rngs=None, cache=None, start=0, details=False,
              features=False):  # fmt: skip
    """`__call__` as traced: op by op when called outside a transformation."""
    rows, pad = tokens_BxS.shape[0], -tokens_BxS.shape[0] % self.mesh.size
    if pad and cache is None:
      repeat_last = lambda a: None if a is None else jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)])
      out, aux = self(
        repeat_last(tokens_BxS),
        positions_BxP=repeat_last(positions_BxP),
        train=train,
        rngs=rngs,
        start=start,
        details=details,
        features=features,
      )
      for name in ("mtp_logits", "mtp_features"):
        if name in aux:
          aux[name] = aux[name][:, :rows]
      return out[:rows], aux
    x_BxSxD, aux, new_cache = backbone.run_blocks(
      self,
      self.embed_tokens(tokens_BxS),
      train=train,
      rngs=rngs,
      cache=cache,
      start=start,
      details=details,
      token_ids=tokens_BxS,
    )
    head = self.head_features if features else self.head_logits
    if train and len(self.mtp):
      h_BxSxD, mtp_heads, aux["mtp_aux_loss"] = x_BxSxD, [], jnp.zeros((), jnp.float32)
      for k, module in enumerate(self.mtp):
        ahead_BxS = jnp.roll(tokens_BxS, -(k + 1), axis=1)  # token i + k + 1 beside h_i; the wrapped end is masked
        ids = backbone.routing_ids(self.cfg, self.moe_cfg, ahead_BxS)
        h_BxSxD, mtp_aux = module(h_BxSxD, self.embed_tokens(ahead_BxS), train=train, rngs=rngs, token_ids=ids)
        mtp_heads.append(head(h_BxSxD, module.norm))
        aux["mtp_aux_loss"] += mtp_aux.get("aux_loss", 0.0)
        # The module's MoE layer after the blocks' (state.moe_layer_paths): its loads update its bias and slots.
        for name in ("expert_counts", "tokens_dropped", "tokens_overflowed", "balance_counts"):
          if name in mtp_aux:
            aux[name] = jnp.concatenate([aux[name], mtp_aux[name][None].astype(aux[name].dtype)])
      aux["mtp_features" if features else "mtp_logits"] = jnp.stack(mtp_heads)
    if positions_BxP is not None:
      x_BxSxD = jnp.take_along_axis(x_BxSxD, positions_BxP[..., None], axis=1)
    out = head(x_BxSxD)
    return (out, aux) if cache is None else (out, aux, new_cache)


def _traced(*arrays) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in arrays)


# Eager calls of a model dispatch hundreds of small ops, each compiled on first use: one program instead.
_compiled_forward = nnx.jit(
  lambda model, tokens_BxS, **kw: model.forward(tokens_BxS, **kw),
  static_argnames=("train", "start", "details", "features"),
)
