"""The SMILE language models: a BERT-like encoder and a GPT-style causal decoder with MoE blocks.

Both stack `num_layers` Transformer blocks in which every `moe_every`-th FFN is an expert-parallel
MoE layer (`moejax.moe.layer`; routing, transport and expert backend come from the MoE config). The
encoder is post-LN as in BERT and SMILE (attention -> residual -> LayerNorm, FFN -> residual ->
LayerNorm) with a BERT MLM head; the decoder is pre-LN as in GPT-2. Both tie their output layer to
the token embeddings. Parameters are fp32; `dtype` is the compute dtype of the matmuls.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.kernels.activations import ACTIVATIONS
from moejax.moe import layer as moe_layer
from moejax.moe.config import DTYPES, MoEConfig
from moejax.validation import ConfigError, is_int, require

KINDS = ("bert", "gpt")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """kind: 'bert' (bidirectional encoder, post-LN, MLM head) or 'gpt' (causal decoder, pre-LN).

  vocab_size: V, rows of the (tied) embedding table. max_len: positions; sequences may be shorter.
  moe_every: FFN of block i is an MoE layer iff (i + 1) % moe_every == 0 (2: every other, as in
    SMILE); 0: no MoE layers. dtype: compute dtype ('float32' or 'bfloat16'); parameters stay fp32.
  embed_init_std: std of the normal initialisation of token and position embeddings (BERT: 0.02;
    LAMB moves each tensor by a fraction of its norm per step, so short runs start larger).
  """

  kind: str
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  d_ff: int
  max_len: int
  dropout: float = 0.1
  moe_every: int = 2
  dtype: str = "float32"
  embed_init_std: float = 0.02

  def __post_init__(self):
    require(self.kind in KINDS, "kind", self.kind, f"one of {KINDS}")
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_len"):
      value = getattr(self, name)
      require(is_int(value), name, value,
              "a positive int")
    require(self.d_model % self.num_heads == 0, "num_heads", self.num_heads,
            f"a divisor of d_model={self.d_model}")
    require(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout", self.dropout,
            "in [0, 1)")
    require(isinstance(self.moe_every, int) and self.moe_every >= 0, "moe_every", self.moe_every,
            "an int >= 0 (0: no MoE layers)")
    require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
    require(isinstance(self.embed_init_std, (int, float)) and self.embed_init_std > 0, "embed_init_std",
            self.embed_init_std, "> 0")

  def is_moe(self, i: int) -> bool:
    return self.moe_every > 0 and (i + 1) % self.moe_every == 0

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe(i) for i in range(self.num_layers))


class Attention(nnx.Module):
  """Multi-head self-attention, softmax in fp32: x [B, S, d] -> [B, S, d]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_heads, self.causal = cfg.num_heads, cfg.kind == "gpt"
    self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
    b, s, d = x_BxSxD.shape
    h = self.num_heads
    qkv_BxSx3xHxW = self.qkv(x_BxSxD).reshape(b, s, 3, h, d // h)
    q_BxSxHxW, k_BxSxHxW, v_BxSxHxW = (qkv_BxSx3xHxW[:, :, i] for i in range(3))
    logits_BxHxSxS = jnp.einsum("bqhk,bshk->bhqs", q_BxSxHxW, k_BxSxHxW,
                                preferred_element_type=jnp.float32) / jnp.sqrt(d // h)
    if self.causal:
      logits_BxHxSxS = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits_BxHxSxS, -1e9)
    probs_BxHxSxS = jax.nn.softmax(logits_BxHxSxS, axis=-1).astype(x_BxSxD.dtype)
    probs_BxHxSxS = self.dropout(probs_BxHxSxS, deterministic=not train, rngs=rngs)
    out_BxSxHxW = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxSxS, v_BxSxHxW)
    return self.out(out_BxSxHxW.reshape(b, s, d))


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

  Calls the layer with the step's key, so router jitter draws from it.
  """

  def __init__(self, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    self.moe = moe_layer.MoELayer(moe_cfg, mesh, rngs=nnx.Rngs(params=rngs.params()))

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    y_BxSxD, aux = self.moe(x_BxSxD, train=train, rng=rng)
    return y_BxSxD, {k: aux[k] for k in ("aux_loss", "expert_counts", "tokens_dropped", "tokens_overflowed")}


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

  def __call__(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None):
    drop = lambda y: self.dropout(y, deterministic=not train, rngs=rngs)
    ffn_rng = rngs.jitter() if train and rngs is not None else None
    if self.pre_ln:
      x_BxSxD = x_BxSxD + drop(self.attn(self.ln_attn(x_BxSxD), train=train, rngs=rngs))
      y_BxSxD, aux = self.ffn(self.ln_ffn(x_BxSxD), train=train, rng=ffn_rng)
      return x_BxSxD + drop(y_BxSxD), aux
    x_BxSxD = self.ln_attn(x_BxSxD + drop(self.attn(x_BxSxD, train=train, rngs=rngs)))
    y_BxSxD, aux = self.ffn(x_BxSxD, train=train, rng=ffn_rng)
    return self.ln_ffn(x_BxSxD + drop(y_BxSxD)), aux


class LanguageModel(nnx.Module):
  """tokens [B, S] int32 (B sharded over both mesh axes) -> (logits [B, S, V] fp32, aux); with
  positions [B, P], logits [B, P, V] at those positions only.

  aux: aux_loss (sum over the MoE layers of their auxiliary losses, SMILE Eq. 5), expert_counts
  [M, E], tokens_dropped [M] and tokens_overflowed [M] for the M MoE layers in order.
  """

  def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    if (moe_cfg.d_model, moe_cfg.d_ff) != (cfg.d_model, cfg.d_ff):
      raise ConfigError(f"MoE widths ({moe_cfg.d_model}, {moe_cfg.d_ff}) differ from the model's "
                        f"d_model={cfg.d_model}, d_ff={cfg.d_ff}")
    self.cfg, self.moe_cfg, self.mesh = cfg, moe_cfg, mesh
    embed_init = nnx.initializers.normal(cfg.embed_init_std)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init, rngs=rngs)
    self.pos_embed = nnx.Param(embed_init(rngs.params(), (cfg.max_len, cfg.d_model)))
    if cfg.kind == "bert":  # BERT's embedding LayerNorm
      self.embed_ln = nnx.LayerNorm(cfg.d_model, epsilon=1e-12, rngs=rngs)
    self.embed_dropout = nnx.Dropout(cfg.dropout)
    self.blocks = nnx.List([Block(cfg, moe_cfg, mesh, cfg.is_moe(i), rngs=rngs) for i in range(cfg.num_layers)])
    if cfg.kind == "bert":  # BERT's MLM transform before the tied decoder
      self.head = nnx.Linear(cfg.d_model, cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
    self.head_ln = nnx.LayerNorm(cfg.d_model, epsilon=1e-12, rngs=rngs)
    self.head_bias = nnx.Param(jnp.zeros((cfg.vocab_size,)))

  def __call__(self, tokens_BxS: jax.Array, *, positions_BxP: jax.Array | None = None, train: bool = False,
               rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    batch_sharding = NamedSharding(self.mesh, P(moe_layer.ALL))
    constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
    s = tokens_BxS.shape[1]
    x_BxSxD = self.embed(tokens_BxS) + self.pos_embed[:s]
    if cfg.kind == "bert":
      x_BxSxD = self.embed_ln(x_BxSxD)
    x_BxSxD = constrain(self.embed_dropout(x_BxSxD, deterministic=not train, rngs=rngs).astype(dtype))
    auxes = []
    for block in self.blocks:
      x_BxSxD, aux = block(x_BxSxD, train=train, rngs=rngs)
      x_BxSxD = constrain(x_BxSxD.astype(dtype))
      if aux:
        auxes.append(aux)
    if positions_BxP is not None:
      x_BxSxD = jnp.take_along_axis(x_BxSxD, positions_BxP[..., None], axis=1)
    if cfg.kind == "bert":
      x_BxSxD = ACTIVATIONS[self.moe_cfg.activation](self.head(x_BxSxD))
    x_BxSxD = self.head_ln(x_BxSxD).astype(dtype)
    logits_BxSxV = jnp.einsum("bld,vd->blv", x_BxSxD, self.embed.embedding[...].astype(dtype),
                              preferred_element_type=jnp.float32) + self.head_bias[...]
    num_experts = self.moe_cfg.num_experts
    aux = {
        "aux_loss": sum((a["aux_loss"] for a in auxes), jnp.zeros((), jnp.float32)),
        "expert_counts": jnp.stack([a["expert_counts"] for a in auxes]) if auxes
                         else jnp.zeros((0, num_experts), jnp.int32),
        **{name: jnp.stack([a[name] for a in auxes]) if auxes else jnp.zeros((0,), jnp.int32)
           for name in ("tokens_dropped", "tokens_overflowed")},
    }
    return logits_BxSxV, aux


def param_specs(params: dict, moe_cfg: MoEConfig) -> dict:
  """PartitionSpecs for a pure-dict parameter tree: experts as `moejax.moe.layer.param_specs`
  (sharded over the mesh on the expert dimension), every dense parameter replicated."""

  def specs(tree):
    if isinstance(tree, dict):
      if set(tree) == {"moe"} and isinstance(tree["moe"], dict):
        return {"moe": moe_layer.param_specs(moe_cfg)}
      return {k: specs(v) for k, v in tree.items()}
    return P()

  return specs(params)


def abstract_state(cfg: ModelConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """(graphdef, params, rest) of the model without allocating anything: params and the other state
  (the MoE layers' key streams) as pure dicts of jax.ShapeDtypeStruct carrying their shardings,
  parameters placed by `param_specs` and everything else replicated."""
  make = lambda: LanguageModel(cfg, moe_cfg, mesh, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  specs = param_specs(params, moe_cfg)
  with_sharding = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  return (graphdef, jax.tree.map(with_sharding, params, specs),
          jax.tree.map(lambda a: with_sharding(a, P()), rest))


def init_state(cfg: ModelConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """(params, rest) as pure dicts, built by one compiled program that places every array as
  `abstract_state` says (with several processes, each holds only its shards)."""
  _, params, rest = abstract_state(cfg, moe_cfg, mesh, seed)
  split = lambda: tuple(nnx.to_pure_dict(s) for s in
                        nnx.split(LanguageModel(cfg, moe_cfg, mesh, rngs=nnx.Rngs(seed)), nnx.Param, ...)[1:])
  shardings = jax.tree.map(lambda a: a.sharding, (params, rest))
  return jax.jit(split, out_shardings=shardings)()
