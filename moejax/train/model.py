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
from moejax.moe.config import DTYPES, MoEConfig
from moejax.moe.module import MoELayer
from moejax.moe.params import param_specs as moe_param_specs
from moejax.runtime import mesh as mesh_lib
from moejax.train import grad_sync as grad_sync_lib
from moejax.validation import ConfigError, is_int, require

KINDS = ("bert", "gpt")
GRAD_SYNCS = ("default", "prioritized")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """kind: 'bert' (bidirectional encoder, post-LN, MLM head) or 'gpt' (causal decoder, pre-LN).

  vocab_size: V, rows of the (tied) embedding table. max_len: positions; sequences may be shorter.
  moe_every: FFN of block i is an MoE layer iff (i + 1) % moe_every == 0 (2: every other, as in
    SMILE); 0: no MoE layers. dtype: compute dtype ('float32' or 'bfloat16'); parameters stay fp32.
  embed_init_std: std of the normal initialisation of token and position embeddings (BERT: 0.02;
    LAMB moves each tensor by a fraction of its norm per step, so short runs start larger).
  tensor_parallel: Megatron-style tensor parallelism of the dense parts over 'gpu': attention heads and
    the dense FFN's hidden units split over the node's GPUs (one all-reduce after each), activations
    sharded over 'node' only, so the MoE layers see their input replicated over 'gpu' (Parm's setting,
    `MoEConfig.esp_schedule`). False: data parallelism over both axes.
  grad_sync: 'default' (XLA places the data-parallel gradient all-reduces) or 'prioritized' (Lina):
    each block's parameter gradients are reduced as one bucket as soon as its backward is done, and the
    gradient flowing on to the block below waits for that bucket, so no bucket's all-reduce runs
    during another block's backward all-to-alls. Same gradients (`moejax.train.grad_sync`).
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
  tensor_parallel: bool = False
  grad_sync: str = "default"

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
    require(isinstance(self.tensor_parallel, bool), "tensor_parallel", self.tensor_parallel, "True or False")
    require(self.grad_sync in GRAD_SYNCS, "grad_sync", self.grad_sync, f"one of {GRAD_SYNCS}")

  def check_mesh(self, gpus_per_node: int) -> None:
    """With tensor parallelism, the heads and the dense FFN split evenly over the node's GPUs."""
    if self.tensor_parallel:
      for name in ("num_heads", "d_ff"):
        value = getattr(self, name)
        require(value % gpus_per_node == 0, name, value,
                f"a multiple of the mesh's {gpus_per_node} GPUs per node (tensor_parallel=True splits it over them)")

  def is_moe(self, i: int) -> bool:
    return self.moe_every > 0 and (i + 1) % self.moe_every == 0

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe(i) for i in range(self.num_layers))


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

  def __init__(self, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    self.moe = MoELayer(moe_cfg, mesh, rngs=nnx.Rngs(params=rngs.params()))

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

  def embed_tokens(self, tokens_BxS: jax.Array, start=0, *, train: bool = False,
                   rngs: nnx.Rngs | None = None) -> jax.Array:
    """tokens [B, S] at positions start .. start + S - 1 -> x [B, S, d] in the compute dtype."""
    x_BxSxD = self.embed(tokens_BxS) + jax.lax.dynamic_slice_in_dim(self.pos_embed[...], start, tokens_BxS.shape[1])
    if self.cfg.kind == "bert":
      x_BxSxD = self.embed_ln(x_BxSxD)
    return self.embed_dropout(x_BxSxD, deterministic=not train, rngs=rngs).astype(jnp.dtype(self.cfg.dtype))

  def head_logits(self, x_BxSxD: jax.Array) -> jax.Array:
    """x [..., d] after the last block -> logits [..., V] fp32 (tied output layer)."""
    dtype = jnp.dtype(self.cfg.dtype)
    if self.cfg.kind == "bert":
      x_BxSxD = ACTIVATIONS[self.moe_cfg.activation](self.head(x_BxSxD))
    x_BxSxD = self.head_ln(x_BxSxD).astype(dtype)
    return jnp.einsum("...d,vd->...v", x_BxSxD, self.embed.embedding[...].astype(dtype),
                      preferred_element_type=jnp.float32) + self.head_bias[...]

  def __call__(self, tokens_BxS: jax.Array, *, positions_BxP: jax.Array | None = None, train: bool = False,
               rngs: nnx.Rngs | None = None, cache=None, start=0, details: bool = False):
    """-> (logits, aux), or (logits, aux, cache) with a KV cache.

    cache: one (k, v) [B, S_cache, H, W] pair per block (`moejax.infer.cache`; 'gpt' only): tokens are at
    positions start .. start + S - 1 and the returned cache holds their keys and values.
    details: aux also holds expert_ids [M, B * S, K] and traffic_rows [M, hops, A, A] per MoE layer.
    """
    dtype = jnp.dtype(self.cfg.dtype)
    batch_sharding = NamedSharding(self.mesh, activation_spec(self.cfg))
    constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
    x_BxSxD = constrain(self.embed_tokens(tokens_BxS, start, train=train, rngs=rngs))
    auxes, new_cache = [], []
    for i, block in enumerate(self.blocks):
      if self.cfg.grad_sync == "prioritized":
        specs = param_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), self.moe_cfg, self.cfg.tensor_parallel)
        x_BxSxD = grad_sync_lib.reduce_before_passing_on(block, x_BxSxD, self.mesh, specs)
      if cache is None:
        x_BxSxD, aux = block(x_BxSxD, train=train, rngs=rngs)
      else:
        x_BxSxD, aux, layer_cache = block(x_BxSxD, train=train, rngs=rngs, cache=(*cache[i], start))
        new_cache.append(layer_cache)
      x_BxSxD = constrain(x_BxSxD.astype(dtype))
      if aux:
        auxes.append(aux)
    if positions_BxP is not None:
      x_BxSxD = jnp.take_along_axis(x_BxSxD, positions_BxP[..., None], axis=1)
    logits_BxSxV = self.head_logits(x_BxSxD)
    num_experts = self.moe_cfg.num_experts
    aux = {
        "aux_loss": sum((a["aux_loss"] for a in auxes), jnp.zeros((), jnp.float32)),
        "expert_counts": jnp.stack([a["expert_counts"] for a in auxes]) if auxes
                         else jnp.zeros((0, num_experts), jnp.int32),
        **{name: jnp.stack([a[name] for a in auxes]) if auxes else jnp.zeros((0,), jnp.int32)
           for name in ("tokens_dropped", "tokens_overflowed")},
    }
    if auxes and "balance_counts" in auxes[0]:  # balance_loss='global_batch': the next micro-batch's input
      aux["balance_counts"] = jnp.stack([a["balance_counts"] for a in auxes])
    if details and auxes:
      aux.update({name: jnp.stack([a[name] for a in auxes]) for name in ("expert_ids", "traffic_rows")})
    return (logits_BxSxV, aux) if cache is None else (logits_BxSxV, aux, new_cache)


def activation_spec(cfg: ModelConfig) -> P:
  """Activations [B, S, d]: the batch over both mesh axes, or over 'node' only with tensor parallelism."""
  return P(mesh_lib.NODE) if cfg.tensor_parallel else P(mesh_lib.AXES)


# Megatron's split of a block's dense kernels over 'gpu' (by the parameter's path suffix): heads of the
# attention projections, hidden units of the dense FFN; the other parameters are replicated.
TENSOR_PARALLEL_SPECS = {
    ("attn", "qkv", "kernel"): P(None, None, mesh_lib.GPU, None), ("attn", "qkv", "bias"): P(None, mesh_lib.GPU, None),
    ("attn", "out", "kernel"): P(mesh_lib.GPU, None, None),
    ("ffn", "w_in", "kernel"): P(None, mesh_lib.GPU), ("ffn", "w_in", "bias"): P(mesh_lib.GPU),
    ("ffn", "w_out", "kernel"): P(mesh_lib.GPU, None),
}


def param_specs(params: dict, moe_cfg: MoEConfig, tensor_parallel: bool = False) -> dict:
  """PartitionSpecs for a pure-dict parameter tree: experts as `moejax.moe.params.param_specs`, dense
  parameters replicated, or with tensor_parallel split over 'gpu' as `TENSOR_PARALLEL_SPECS`."""

  def specs(tree, path=()):
    if isinstance(tree, dict):
      if set(tree) == {"moe"} and isinstance(tree["moe"], dict):
        return {"moe": moe_param_specs(moe_cfg)}
      return {k: specs(v, path + (k,)) for k, v in tree.items()}
    return TENSOR_PARALLEL_SPECS.get(path[-3:], P()) if tensor_parallel else P()

  return specs(params)


def abstract_state(cfg: ModelConfig, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, seed: int = 0):
  """(graphdef, params, rest) of the model without allocating anything: params and the other state
  (the MoE layers' key streams) as pure dicts of jax.ShapeDtypeStruct carrying their shardings,
  parameters placed by `param_specs` and everything else replicated."""
  make = lambda: LanguageModel(cfg, moe_cfg, mesh, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  cfg.check_mesh(mesh_lib.axis_sizes(mesh)[1])
  specs = param_specs(params, moe_cfg, cfg.tensor_parallel)
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


def moe_block_indices(cfg: ModelConfig) -> list[int]:
  """The blocks whose FFN is an MoE layer, in order (MoE layer j is block moe_block_indices(cfg)[j])."""
  return [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


def _stacked(cfg: ModelConfig, rest: dict, name: str):
  """The MoE layers' state `name` stacked over the layers ([M, ...]) from the pure-dict `rest`, or None
  when the layers have none (ShapeDtypeStructs in, one ShapeDtypeStruct with the sharding out)."""
  values = [rest["blocks"][i]["ffn"]["moe"].get(name) for i in moe_block_indices(cfg)]
  if not values or values[0] is None:
    return None
  if isinstance(values[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(values), *values[0].shape), values[0].dtype, sharding=values[0].sharding)
  return jnp.stack(values)


def _with_stacked(cfg: ModelConfig, rest: dict, name: str, stacked) -> dict:
  """`rest` with MoE layer j's state `name` replaced by stacked[j] (the rest of the tree shared)."""
  blocks = dict(rest["blocks"])
  for j, i in enumerate(moe_block_indices(cfg)):
    moe = {**blocks[i]["ffn"]["moe"], name: stacked[j]}
    blocks[i] = {**blocks[i], "ffn": {**blocks[i]["ffn"], "moe": moe}}
  return {**rest, "blocks": blocks}


def slot_tables(cfg: ModelConfig, rest: dict):
  """[M, A, Z] int32: the MoE layers' slot tables stacked from the pure-dict `rest` (the non-parameter
  state of `abstract_state`/`init_state`), or None without replication (moe.slots_per_device unset)."""
  return _stacked(cfg, rest, "slot_expert")


def with_slot_tables(cfg: ModelConfig, rest: dict, tables_MxAxZ) -> dict:
  """`rest` with MoE layer j's slot table replaced by tables_MxAxZ[j] (the rest of the tree shared)."""
  return _with_stacked(cfg, rest, "slot_expert", tables_MxAxZ)


def expert_biases(cfg: ModelConfig, rest: dict):
  """[M, E] float32: the MoE layers' auxiliary-loss-free balancing biases (`ExpertBias`) stacked from the
  pure-dict `rest`, or None without them (moe.bias_update_rate = 0)."""
  return _stacked(cfg, rest, "expert_bias")


def with_expert_biases(cfg: ModelConfig, rest: dict, bias_MxE) -> dict:
  """`rest` with MoE layer j's balancing bias replaced by bias_MxE[j] (the rest of the tree shared)."""
  return _with_stacked(cfg, rest, "expert_bias", bias_MxE)


def balance_counts(cfg: ModelConfig, rest: dict):
  """[M, cfg.balance_counts_size] float32: the MoE layers' earlier-micro-batch choice counts (`BalanceCounts`, balance_loss=
  'global_batch') from the pure-dict `rest`, or None without them."""
  return _stacked(cfg, rest, "balance_counts")


def with_balance_counts(cfg: ModelConfig, rest: dict, earlier_counts) -> dict:
  """`rest` with MoE layer j's earlier-micro-batch choice counts replaced by earlier_counts[j]."""
  return _with_stacked(cfg, rest, "balance_counts", earlier_counts)
