"""What one block of a model keeps for its backward, part by part, for the memory planner's analytic count
(`moejax.study.memory.analytic_activations`, docs/memory.md): its attention (by the implementation that runs on the
planned GPU), its dense FFN or MoE layer, and the output heads' loss."""

import numpy as np

from moejax.models import attention as attention_lib
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
