"""What one block of a model keeps for its backward, part by part, for the memory planner's analytic count
(`moejax.study.memory.analytic_activations`, docs/memory.md): its attention (by the implementation that runs on the
planned GPU) or another token mixer (what JAX's autodiff keeps for it, traced), its dense FFN or MoE layer, the
block kind's own parts (DeepSeek-V4's mHC streams, LongCat-Flash's two sublayers), and the output heads' loss."""

import math

import jax
import numpy as np
from flax import nnx

from moejax.models import attention as attention_lib
from moejax.models import hyper_block, shortcut_block, sparse_attention, token_mixers
from moejax.models.decoder_config import DecoderConfig

PLANNED_GPU = (9, 0)  # the compute capability attention is planned for: a Hopper GPU (`platform.TARGET_GPU`'s)


def planned_attention(cfg) -> str:
  """What attention runs on a Hopper GPU (`attention.planned`: cuDNN's rules without its trial run): XLA's (the
  scores materialised), cuDNN's or tokamax's (fused: neither keeps them). SMILE's blocks materialise theirs; a
  decoder family runs its attention_impl, 'auto' being 'cudnn' where cuDNN's rules take the layer, else 'xla'."""
  if not isinstance(cfg, DecoderConfig):
    return attention_lib.IMPLEMENTATIONS["xla"].name
  return attention_lib.planned(cfg.attention_impl, cfg.dtype, _attention_widths(cfg)[2], PLANNED_GPU).name


def _attention_widths(cfg) -> tuple[int, int, int]:
  """(q and k head width, v head width, the width jax.nn's attention runs at: the wider, v and the output padded to
  it) of a decoder family."""
  qk, v = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.latent else (cfg.head_dim, cfg.value_dim)
  return qk, v, max(qk, v)


def block_bytes(cfg, moe_cfg, rows: int, seq_len: int, exchange: dict | None) -> dict:
  """One block's parts without remat, bytes on one device for `rows` sequences of `seq_len` tokens: 'attention' (the
  norms' inputs and outputs, q, k, v and the output), 'scores' (what the softmax keeps: `planned_attention`),
  'dense_ffn', 'moe_ffn' (with 'exchanged', its rows received), and 'impl' (the attention's name)."""
  decoder = isinstance(cfg, DecoderConfig)
  b = np.dtype(cfg.dtype).itemsize
  t, d, h = rows * seq_len, cfg.d_model, cfg.num_heads
  impl = attention_lib.IMPLEMENTATIONS[planned_attention(cfg)]
  if decoder:
    qk, v, wide = _attention_widths(cfg)
    kv_heads = h if cfg.latent else cfg.num_kv_heads  # q and the output: h heads; k and v: kv_heads
    qkv = (2 * h + 2 * kv_heads) * wide if impl.pads_values else h * (qk + v) + kv_heads * (qk + v)
  else:
    qkv = 4 * d
  scores = rows * h * seq_len * (seq_len * (4 + b) if impl.keeps_scores else 4)
  moe_ffn = exchanged = 0
  if cfg.num_moe_layers:
    expert_rows = exchange["buffer_rows"] or t * moe_cfg.choices_per_token
    exchanged = sum(exchange["hop_rows"]) * d * b
    mats = 3 if moe_cfg.gated else 2
    moe_ffn = (
      t * moe_cfg.num_experts * 4
      + exchanged
      + expert_rows * mats * moe_cfg.d_ff * b
      + t * mats * moe_cfg.shared_width * b
      + t * d * 4
    )
  return {
    "attention": 4 * t * d * b + t * qkv * b,
    "scores": scores,
    "dense_ffn": t * (d + 3 * cfg.d_ff) * b,
    "moe_ffn": moe_ffn,
    "exchanged": exchanged,
    "impl": impl.name,
  }


def layer_blocks(cfg, moe_cfg, rows: int, seq_len: int, exchange: dict | None) -> tuple[list, dict]:
  """(per layer, then per MTP module: {'none': what the block keeps without remat, 'input': what remat='full' keeps
  of it (its input), 'exchanged': its MoE layer's exchanged rows, 'scores': its attention's softmax, 'moe': whether its
  FFN is the MoE layer}, `block_bytes`' parts). A block is its norms' inputs and outputs (4 T d), its token mixer
  (attention by `block_bytes`, another by `traced_mixer_bytes`) and its FFN; by the family's block: mHC layers
  (`hyper_block.uses`) add two wraps (`mhc_bytes`, each with its N streams in) and take N streams in, ScMoE layers
  (`shortcut_block.uses`) have two attentions and two dense FFNs (eight norm inputs and outputs) beside the MoE
  branch. An MTP module is a plain MoE block."""
  parts = block_bytes(cfg, moe_cfg, rows, seq_len, exchange)
  b, t, d = np.dtype(cfg.dtype).itemsize, rows * seq_len, cfg.d_model
  norms, attention, scores = 4 * t * d * b, parts["attention"] - 4 * t * d * b, parts["scores"]
  hyper, shortcut = hyper_block.uses(cfg), shortcut_block.uses(cfg)
  streams = hyper_block.hyper_config(cfg).hc_mult if hyper else 1
  wraps = 2 * (mhc_bytes(cfg, rows, seq_len) + streams * t * d * b) if hyper else 0  # each wrap keeps its streams in

  def block(mixer, moe, own_kind=True):
    """A layer (own_kind: of the family's block) or an MTP module; mixer: its traced bytes, None for attention."""
    mixer, softmax = (attention, scores) if mixer is None else (mixer, 0)
    ffn = parts["moe_ffn"] if moe else parts["dense_ffn"]
    none = norms + mixer + softmax + ffn + (wraps if own_kind else 0)
    if own_kind and shortcut:
      none, softmax = none + norms + mixer + softmax + 2 * parts["dense_ffn"], 2 * softmax
    width = streams if own_kind else 1
    exchanged = parts["exchanged"] if moe else 0
    return {"none": none, "input": width * t * d * b, "exchanged": exchanged, "scores": softmax, "moe": moe}

  traced = traced_mixer_bytes(cfg, rows, seq_len)
  layers = [block(traced[i] if traced else None, cfg.is_moe(i)) for i in range(cfg.num_layers)]
  mtp = [block(None, bool(cfg.num_moe_layers), own_kind=False) for _ in range(getattr(cfg, "num_mtp_layers", 0))]
  return layers + mtp, parts


def head_bytes(cfg, tokens: int, mtp: int, loss_chunk: int) -> tuple[float, int]:
  """(what the main head and `mtp` MTP modules' heads keep, the vocabulary chunk): unchunked every head's logits
  kept for the backward; chunked every head's input and three floats a token, one chunk live at a time, and h's
  float32 gradient."""
  b, d = np.dtype(cfg.dtype).itemsize, cfg.d_model
  chunk = min(loss_chunk or cfg.vocab_size, cfg.vocab_size)
  if chunk == cfg.vocab_size:
    return (1 + mtp) * loss_bytes(tokens, cfg.vocab_size, 0), chunk
  return (1 + mtp) * tokens * (d * b + 3 * 4) + loss_bytes(tokens, cfg.vocab_size, chunk) + tokens * d * 4, chunk


def loss_bytes(tokens: int, vocab: int, loss_chunk: int) -> float:
  """What one head's loss holds at once beside its inputs, as XLA compiles `objective.head_cross_entropy_sums` with
  its backward (tests/test_memory_planner.py): unchunked (0) the float32 logits and their gradient, 2 T V x 4; in
  chunks of c columns one chunk's logits, probabilities and their gradient, 3 T c x 4."""
  if not loss_chunk or loss_chunk >= vocab:
    return 2.0 * tokens * vocab * 4
  return 3.0 * tokens * loss_chunk * 4


def residual_bytes(fn, *specs) -> int:
  """Bytes JAX's autodiff keeps for the backward of fn(*specs) beyond fn's own arguments (weights, inputs): the
  residuals of jax.vjp, traced on the abstract `specs` (jax.ShapeDtypeStruct trees: nothing allocated or
  compiled). Mostly above what XLA keeps, which may recompute a cheap residual inside the backward's fusions
  (tests/test_memory_mixers.py measures by how much)."""
  kept = []

  def trace(*args):
    out, backward = jax.vjp(fn, *args)
    given = {id(a) for a in jax.tree.leaves(args)}
    kept.append(sum(math.prod(r.shape) * r.dtype.itemsize for r in jax.tree.leaves(backward) if id(r) not in given))
    return out

  jax.eval_shape(trace, *specs)
  return kept[0]


def traced_mixer_bytes(cfg, rows: int, seq_len: int) -> list:
  """Per layer, what its token mixer keeps for its backward on `rows` sequences of `seq_len` tokens, its input aside
  (`residual_bytes` of the module built abstractly); None for an 'attention' layer (`block_bytes` counts it). A kind
  of mixer with the same cache shapes (DeepSeek-V4's sliding, CSA, HCA layers differ) is traced once."""
  x = jax.ShapeDtypeStruct((rows, seq_len, cfg.d_model), np.dtype(cfg.dtype))
  traced, out = {}, []
  for layer in range(cfg.num_layers if isinstance(cfg, DecoderConfig) else 0):
    mixer = token_mixers.of(cfg, layer)
    kind = (mixer.name, repr(mixer.cache(cfg, layer, rows, seq_len)))
    if mixer.name != "attention" and kind not in traced:
      graphdef, state = nnx.split(nnx.eval_shape(lambda: mixer.build(cfg, layer, rngs=nnx.Rngs(0))))
      call = lambda state_, x_, g=graphdef: nnx.merge(g, state_)(sparse_attention.begin(cfg, x_))
      traced[kind] = residual_bytes(call, state, x)
    out.append(traced.get(kind))
  return out


def mhc_bytes(cfg, rows: int, seq_len: int) -> int:
  """What one mHC wrap of a sublayer keeps for its backward beyond the streams and the sublayer's output (DeepSeek-V4:
  `hyper_connections.mixing_weights` then `merge`; `residual_bytes`)."""
  config = hyper_block.hyper_config(cfg)
  n, d, dtype = config.hc_mult, cfg.d_model, np.dtype(cfg.dtype)
  spec = lambda *shape, dt=np.float32: jax.ShapeDtypeStruct(shape, dt)
  params = {"fn": spec(config.num_weights, n * d), "base": spec(config.num_weights), "scale": spec(3)}

  def wrap(params_, streams, y):
    _, post, comb, collapsed = hyper_block.hc.mixing_weights(params_, streams, config)
    return hyper_block.hc.merge(post, comb, y, streams), collapsed

  return residual_bytes(wrap, params, spec(rows, seq_len, n, d, dt=dtype), spec(rows, seq_len, d, dt=dtype))
