"""The memory planner's arithmetic (`experiments/memory.py` runs it): per-device bytes of a training config's state
from its shardings, one MoE layer's exchange buffers, and an analytic count from the config's dimensions alone
(parameters, optimizer states, gradients, activations; a block's parts in `memory_blocks`) to set beside the
compiled numbers (`memory_compile`). docs/memory.md documents every formula."""

import math

import numpy as np

from moejax.models.decoder_config import DecoderConfig
from moejax.moe import path as path_lib
from moejax.runtime import mesh as mesh_lib
from moejax.study import memory_blocks, memory_leaves
from moejax.study.memory_leaves import Leaf, decoder_leaves, moe_leaves
from moejax.train import optim as optim_lib

GB = 1e9  # bytes; verdicts and tables are in GB (10^9 bytes)


def shard_bytes(leaf) -> int:
  """Bytes one device holds of a jax.ShapeDtypeStruct with a sharding: its shard's elements x the item size."""
  return math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def layer_counts(cfg) -> tuple[int, int]:
  """(dense, MoE) blocks of a model config (MTP modules not counted: they are in every compiled variant)."""
  moe = cfg.num_moe_layers
  return cfg.num_layers - moe, moe


def exchange_bytes(moe_cfg, mesh, tokens: int) -> dict:
  """One MoE layer's receive buffers per device, as `experiments/exchange_memory.py` counts them (the layer's own
  `moe.path.hop_sizes` with `moe.collective.buffer_bound`): each hop's buffer of rows x d in the dispatch dtype, and
  the combine's buffer of the same rows back in the combine dtype. `tokens`: the tokens of one layer call."""
  from moejax.moe import layout as layout_lib  # after the device count is set

  lay = layout_lib.layout(moe_cfg, tokens, mesh)
  sizes = path_lib.hop_sizes(
    lay.hops,
    {mesh_lib.NODE: lay.n, mesh_lib.GPU: lay.m},
    lay.rows,
    lay.slots,
    lay.collective,
    lay.buffer_rows,
    lay.dedup,
  )
  rows = [h.out_rows for h in sizes]
  item = lambda name, default: np.dtype(name or default).itemsize
  dispatch, combine = item(moe_cfg.dispatch_dtype, moe_cfg.dtype), item(moe_cfg.combine_dtype, "float32")
  return {
    "hop_rows": rows,
    "buffer_rows": lay.buffer_rows,
    "rows_sent": lay.rows,
    "slots": lay.slots,
    "bytes": sum(rows) * moe_cfg.d_model * (dispatch + combine),
  }


def _smile_leaves(cfg) -> tuple[list, list, list]:
  """The same for a SMILE model (`ModelConfig`): tied embeddings, learned positions, LayerNorms with biases."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  top = [Leaf((v, d), table=True), Leaf((cfg.max_len, d), table=True), Leaf((d,), 2), Leaf((v,))]
  top += [Leaf((d,), 2), Leaf((d, d)), Leaf((d,))] if cfg.kind == "bert" else []
  w = d // cfg.num_heads
  attn = [
    Leaf((d,), 4),
    Leaf((d, 3, cfg.num_heads, w)),
    Leaf((3, cfg.num_heads, w)),
    Leaf((cfg.num_heads, w, d)),
    Leaf((d,)),
  ]
  return top, attn, [Leaf((d, f)), Leaf((f,)), Leaf((f, d)), Leaf((d,))]


PARTS = ("embeddings", "layers", "head")


def analytic_leaves(cfg, moe_cfg) -> dict:
  """The model's parameter leaves by where a pipeline puts them (`pipeline_count`): 'embeddings' (the token
  embeddings: the first stage; a SMILE model's positions too), 'layers' (every block's attention, dense FFN and MoE
  layer, each decoder layer by its kind: `memory_leaves.layer_leaves`; split over the stages) and 'head' (the final
  norm, the output kernel and the MTP modules: the last stage)."""
  decoder = isinstance(cfg, DecoderConfig)
  dense, moe = layer_counts(cfg)
  if decoder:
    top = memory_leaves.top_leaves(cfg)
    layers = [x for layer in range(cfg.num_layers) for x in memory_leaves.layer_leaves(cfg, moe_cfg, layer)]
    attn = memory_leaves.decoder_leaves(cfg)[1]
  else:
    top, attn, ffn = _smile_leaves(cfg)
    layers = [Leaf(x.shape, x.count * (dense + moe), x.kind) for x in attn]
    layers += [Leaf(x.shape, x.count * dense, x.kind) for x in ffn]
    layers += [Leaf(x.shape, x.count * moe, x.kind) for x in moe_leaves(moe_cfg)] if moe else []
  embeddings = top[:2] if not decoder else top[:1]
  head = top[len(embeddings) :]
  mtp = getattr(cfg, "num_mtp_layers", 0)
  if mtp:  # each MTP module: enorm, hnorm, eh_proj, its own norm, and one more block (attention and MoE FFN)
    d = cfg.d_model
    head += [Leaf((d,), 3 * mtp), Leaf((2 * d, d), mtp)] + [Leaf(x.shape, x.count * mtp, x.kind) for x in attn]
    head += [Leaf(x.shape, x.count * mtp, x.kind) for x in moe_leaves(moe_cfg)] if moe else []
  return {"embeddings": embeddings, "layers": layers, "head": head}


def analytic_state(cfg, moe_cfg, nodes: int, gpus: int, optim=None, parts: tuple = PARTS) -> dict:
  """Per-device bytes of parameters, gradients and optimizer states from the config's dimensions alone: every
  tensor's shape written out per layer kind (embeddings, attention, dense FFN, MoE layer, MTP module), placed as the
  sharding rules say (experts over their holders; with FSDP a dense tensor over all devices on a dimension they
  divide, the MoE layers' routers and shared experts too). Gradients accumulate in float32 (the trainer's
  `precision.zeros_for_accumulation`). The optimizer (`optim`: the config's optim section; None: today's defaults,
  `moejax.train.optim.DEFAULTS`) keeps with master_dtype a float32 master copy of every parameter, and moments in
  moment_dtype (else in the master's dtype, else the parameters'): two of each parameter (LAMB's and AdamW's m and
  v), or under 'muon' one of each matrix it orthogonalises (`Leaf.muon`) and two of the rest. `parts`: which of
  `analytic_leaves`' groups to count (a pipeline stage's)."""
  get = lambda name: optim_lib.DEFAULTS[name] if optim is None else optim.get(name, optim_lib.DEFAULTS[name])
  groups = analytic_leaves(cfg, moe_cfg)
  leaves = [x for part in parts for x in groups[part]]
  devices = nodes * gpus
  holders = gpus if moe_cfg.expert_data_parallel else devices

  def per_device(leaf: Leaf) -> float:
    """The leaf's elements on one device."""
    size = math.prod(leaf.shape) * leaf.count
    if leaf.kind == "expert":
      return size / holders
    if leaf.kind in ("dense", "moe") and cfg.fsdp and any(s % devices == 0 for s in leaf.shape):
      return size / devices
    return size

  elements = sum(per_device(x) for x in leaves)
  item = lambda dtype: np.dtype(dtype).itemsize
  param_item = lambda leaf: item("float32" if leaf.float32 else getattr(cfg, "param_dtype", "float32"))
  moment_dtype = get("moment_dtype") or get("master_dtype")
  moment_item = lambda leaf: item(moment_dtype) if moment_dtype else param_item(leaf)
  moments_of = lambda leaf: 1 if get("name") == "muon" and leaf.muon else 2
  master = elements * item(get("master_dtype")) if get("master_dtype") else 0.0
  moments = sum(per_device(x) * moments_of(x) * moment_item(x) for x in leaves)
  return {
    "parameters": sum(per_device(x) * param_item(x) for x in leaves),
    "gradients": elements * item("float32"),
    "optimizer": master + moments,
    "master_weights": master,
    "moments": moments,
    "parameter_count": memory_leaves.size(leaves),
  }


def analytic_activations(cfg, moe_cfg, rows: int, seq_len: int, exchange: dict | None, loss_chunk: int = 0) -> dict:
  """A per-block estimate of what one micro-batch's forward keeps for the backward on one device (docs/memory.md):
  `rows` sequences of `seq_len` tokens. Per block (`memory_blocks.layer_blocks`: by the family's block kind) without
  remat: the norms' inputs and outputs (4 T d), q, k, v and the attention output (MLA's v and output padded to q's
  width, as jax.nn's attention takes them), the attention's softmax (`memory_blocks.planned_attention`: 'xla' keeps
  the scores B H S^2 in float32 and their probabilities in the compute dtype, a fused kernel its log-sum-exp B H S in
  float32), or for another token mixer what JAX's autodiff keeps for it (`memory_blocks.traced_mixer_bytes`), DeepSeek-V4's
  mHC wraps (`memory_blocks.mhc_bytes`), the dense FFN's input, gate, up and product
  (T (d + 3 f)), or the MoE layer's router logits (T E float32), the rows it exchanged and their expert hidden states
  (3 f per row), its shared experts' (3 f_s per token) and its float32 combine (T d). remat='full' keeps each
  block's input only (scanned or not: in a scan, the loop's stacked input [L, B, S, d]), plus one block recomputed
  with its gradients (twice the largest block's 'none' bytes: a scan's backward runs one layer's body at a time; mHC
  blocks take N streams in); 'save_exchanged'
  also the exchanged rows; 'save_matmuls' everything but the attention scores (batched matmuls are not saved).
  The output heads (the main one and each MTP module's): with loss_chunk = 0 each keeps its float32 logits and
  their gradient, else each keeps its input h (T d) and three floats a token, and one chunk at a time is live
  (`memory_blocks.loss_bytes`) with h's float32 gradient (T d x 4). With FSDP, the weights gathered
  (`_gathered_bytes`)."""
  t = rows * seq_len
  blocks, parts = memory_blocks.layer_blocks(cfg, moe_cfg, rows, seq_len, exchange)
  mtp = getattr(cfg, "num_mtp_layers", 0)
  head, chunk = memory_blocks.head_bytes(cfg, t, mtp, loss_chunk)

  def kept(block: dict) -> float:
    """What a block keeps for the backward (remat: beside the recomputed block)."""
    extra = {"save_exchanged": 2 * block["exchanged"], "save_matmuls": block["none"] - block["scores"]}
    return block["none"] if cfg.remat == "none" else block["input"] + extra.get(cfg.remat, 0)

  layers, mtp_blocks = blocks[: cfg.num_layers], blocks[cfg.num_layers :]
  recomputed = 0 if cfg.remat == "none" else 2 * max(block["none"] for block in blocks)
  mean = lambda moe: float(np.mean([x["none"] for x in layers if x["moe"] == moe] or [0.0]))
  gathered = _gathered_bytes(cfg, moe_cfg) if cfg.fsdp else 0.0
  layer_bytes, mtp_bytes = sum(map(kept, layers)), sum(map(kept, mtp_blocks))
  return {
    "activations": float(layer_bytes + mtp_bytes + recomputed + head + gathered),
    "layers": float(layer_bytes),
    "mtp_blocks": float(mtp_bytes),
    "recomputed_block": float(recomputed),
    "per_dense_block": mean(False),
    "per_moe_block": mean(True),
    "attention": parts["impl"],
    "attention_scores_per_block": float(parts["scores"]),
    "head": float(head),
    "loss_chunk": chunk if chunk < cfg.vocab_size else 0,
    "gathered_weights": gathered,
  }


def _gathered_bytes(cfg, moe_cfg) -> float:
  """What FSDP gathers beside the sharded state, per device: the token embeddings and the output layer's kernel
  (the same table when tied) whole in the compute dtype, and the output kernel's gradient whole before it is
  reduce-scattered; one layer's dense weights (the larger kind: attention with a dense FFN, or with the MoE
  layer's routers and shared experts; its experts stay sharded) gathered for the forward, again for the backward,
  and their gradient before the reduce-scatter: in a scan one layer at a time (three of the largest layer)."""
  top, attn, ffn = decoder_leaves(cfg) if isinstance(cfg, DecoderConfig) else _smile_leaves(cfg)
  b, pd = np.dtype(cfg.dtype).itemsize, np.dtype(getattr(cfg, "param_dtype", "float32")).itemsize
  table = cfg.vocab_size * cfg.d_model
  tables = (1 if getattr(cfg, "tie_embeddings", True) else 2) * table * b + table * b
  moe_dense = [x for x in moe_leaves(moe_cfg) if x.kind == "moe"] if cfg.num_moe_layers else []
  size = memory_leaves.size
  layer = size(attn) + max(size(ffn) if layer_counts(cfg)[0] else 0, size(moe_dense))
  return float(tables + 3 * layer * pd)
