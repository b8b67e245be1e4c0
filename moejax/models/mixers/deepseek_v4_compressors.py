"""DeepSeek-V4's compressed KV (transformers' `DeepseekV4HCACompressor`, `DeepseekV4CSACompressor` and its
`DeepseekV4Indexer`): the extra keys = values a compressed layer's queries see after their sliding window, as pure
functions over the layer's tensors under `model.layers.{i}.self_attn.` (W = head_dim, m = compress_rate,
I = index_head_dim, H_I = index heads, R_q = q_lora_rank; C = W for HCA, 2 W for CSA):

  compressor.kv_proj.weight [C, D], compressor.gate_proj.weight [C, D], compressor.position_bias [m, C] (float32),
  compressor.kv_norm.weight [W] (float32)
  CSA only, the indexer: compressor.indexer.{kv_proj,gate_proj}.weight [2 I, D], .position_bias [m, 2 I],
  .kv_norm.weight [I], .q_b_proj.weight [H_I I, R_q], .scorer.weights_proj.weight [H_I, D]

Window w is the tokens w m .. w m + m - 1. HCA's entry w pools window w: per feature, softmax over the window's
tokens of gate + position_bias weighs their kv. CSA's entry w pools 2 m slots: window w - 1's first W features
(Ca, with the bias's first half) and window w's last W (Cb); window -1 has weight 0. Each entry is RMS-normed and
rotated (the 'compress' rope) at position w m. A query at token t sees entry w once its window is complete,
(w + 1) m <= t + 1; CSA's query sees only the index_topk of those its indexer scores highest: the indexer pools its
own keys (width I) the same way and scores sum_h weights_proj(x)_h H_I^-1/2 relu(q_h . key) I^-1/2, q the rotated
q_b_proj of the query's normed low-rank q. Causality counts tokens (as the sliding window), as transformers'
caches do; its whole-sequence mask reads position_ids instead, the same where they are 0, 1, 2, ...

The decode cache holds, per pooled series (the compressor's, and the indexer's), the projections (kv and gate) of
the last m tokens (2 m for CSA: the open window and, for its Ca, the last complete one), and the entries so far in
`max_length // m` slots.
"""

import jax
import jax.numpy as jnp

from moejax.models.mixers.deepseek_v4_ops import linear, rms_norm, rotate_tail

COMPRESSOR, INDEXER = "compressor.", "compressor.indexer."


def _overlap(cfg) -> int:
  """1 where an entry also pools the window before its own (CSA), else 0 (HCA)."""
  return int(cfg.layer_type == "compressed_sparse_attention")


def _series(cfg) -> tuple[tuple[str, int], ...]:
  """(tensor prefix, entry width) of each pooled series: the compressor's, then (CSA) the indexer's keys."""
  main = ((COMPRESSOR, cfg.head_dim),)
  return main + ((INDEXER, cfg.index_head_dim),) if _overlap(cfg) else main


def param_shapes(cfg) -> dict:
  """The compressors' tensors' shapes by name under `self_attn.` (none for a sliding layer)."""
  if cfg.layer_type == "sliding_attention":
    return {}
  shapes = {}
  for prefix, width in _series(cfg):
    c = (1 + _overlap(cfg)) * width
    shapes.update(
      {
        f"{prefix}kv_proj.weight": (c, cfg.hidden_size),
        f"{prefix}gate_proj.weight": (c, cfg.hidden_size),
        f"{prefix}position_bias": (cfg.compress_rate, c),
        f"{prefix}kv_norm.weight": (width,),
      }
    )
  if _overlap(cfg):
    shapes[f"{INDEXER}q_b_proj.weight"] = (cfg.index_num_heads * cfg.index_head_dim, cfg.q_lora_rank)
    shapes[f"{INDEXER}scorer.weights_proj.weight"] = (cfg.index_num_heads, cfg.hidden_size)
  return shapes


def _pool(params, prefix: str, kv_BxNxC, gate_BxNxC, first: jax.Array, width: int, cfg) -> jax.Array:
  """The entries of windows first .. first + n - 1 -> [B, n, width], from the projections of N = (n + P) m tokens
  starting at window first - P's (P = 1 for CSA). first may be traced (decode)."""
  m, p = cfg.compress_rate, _overlap(cfg)
  b, n, c = kv_BxNxC.shape[0], kv_BxNxC.shape[1] // m - p, kv_BxNxC.shape[2]
  kv = kv_BxNxC.reshape(b, n + p, m, c)  # c, not -1: n may be 0
  # the float32 bias promotes the gate: the softmax is float32, its weights cast to kv's dtype, as transformers'
  gate = gate_BxNxC.reshape(b, n + p, m, c).astype(jnp.float32) + params[f"{prefix}position_bias"].astype(jnp.float32)
  windows = first + jnp.arange(n)
  if p:  # slots: the previous window's Ca, then this window's Cb; before window 0 nothing (weight 0)
    ca_gate = jnp.where((windows == 0)[None, :, None, None], -jnp.inf, gate[:, :-1, :, :width])
    kv = jnp.concatenate([kv[:, :-1, :, :width], kv[:, 1:, :, width:]], axis=2)
    gate = jnp.concatenate([ca_gate, gate[:, 1:, :, width:]], axis=2)
  pooled = jnp.sum(kv * jax.nn.softmax(gate, axis=2).astype(kv.dtype), axis=2)
  pooled = rms_norm(pooled, params[f"{prefix}kv_norm.weight"], cfg.rms_eps)
  positions_BxN = jnp.broadcast_to(windows * m, (b, n))
  return rotate_tail(pooled[:, :, None], positions_BxN, cfg)[:, :, 0]


def _sequence_entries(params, prefix: str, width: int, x_BxSxD, cfg) -> jax.Array:
  """Every complete window's entry of a sequence from its start -> [B, S // m, width] (the rest waits)."""
  m, p = cfg.compress_rate, _overlap(cfg)
  tokens = (x_BxSxD.shape[1] // m) * m
  kv = linear(x_BxSxD[:, :tokens], params[f"{prefix}kv_proj.weight"])
  gate = linear(x_BxSxD[:, :tokens], params[f"{prefix}gate_proj.weight"])
  before = jnp.zeros((kv.shape[0], p * m, kv.shape[2]), kv.dtype)  # window -1, masked in `_pool`
  return _pool(params, prefix, jnp.concatenate([before, kv], 1), jnp.concatenate([before, gate], 1), 0, width, cfg)


def _complete(tokens_S: jax.Array, entries: int, m: int) -> jax.Array:
  """[S, entries]: whether entry w's window has ended by token t, (w + 1) m <= t + 1."""
  return jnp.arange(entries)[None, :] < ((tokens_S + 1) // m)[:, None]


def _selected(params, x_BxSxD, q_residual_BxSxR, positions_BxS, keys_BxTxI, visible_SxT, cfg) -> jax.Array:
  """[B, S, T]: the visible entries among each query's index_topk best scored (all of them when fewer). The choice
  is piecewise constant: no gradient reaches the indexer, as in transformers (DeepSeek trains it on its own loss)."""
  b, s, _ = x_BxSxD.shape
  heads, width, t = cfg.index_num_heads, cfg.index_head_dim, keys_BxTxI.shape[1]
  visible_BxSxT = jnp.broadcast_to(visible_SxT, (b, s, t))
  if t == 0:
    return visible_BxSxT
  q = linear(q_residual_BxSxR, params[f"{INDEXER}q_b_proj.weight"]).reshape(b, s, heads, width)
  q = rotate_tail(q, positions_BxS, cfg)
  dots = jnp.einsum("bshi,bti->bsht", q, keys_BxTxI, preferred_element_type=jnp.float32)
  weights = linear(x_BxSxD, params[f"{INDEXER}scorer.weights_proj.weight"]).astype(jnp.float32) * heads**-0.5
  scores = jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots) * width**-0.5, weights)
  scores = jax.lax.stop_gradient(jnp.where(visible_BxSxT, scores, -jnp.inf))
  _, best = jax.lax.top_k(scores, min(cfg.index_topk, t))
  chosen = jnp.put_along_axis(jnp.zeros((b, s, t), bool), best, True, axis=-1, inplace=False)
  return chosen & visible_BxSxT


def compressed_kv(params, x_BxSxD, q_residual_BxSxR, positions_BxS, cfg) -> tuple[jax.Array, jax.Array]:
  """A whole sequence's (prefill, training) compressed keys = values and which each query sees: -> (entries
  [B, T, W], visible [B, S, T]), T = S // m. q_residual: the query's normed low-rank q_a_norm(q_a_proj(x))."""
  s = x_BxSxD.shape[1]
  entries = _sequence_entries(params, COMPRESSOR, cfg.head_dim, x_BxSxD, cfg)
  visible_SxT = _complete(jnp.arange(s), entries.shape[1], cfg.compress_rate)
  if not _overlap(cfg):
    return entries, jnp.broadcast_to(visible_SxT, (x_BxSxD.shape[0], *visible_SxT.shape))
  keys = _sequence_entries(params, INDEXER, cfg.index_head_dim, x_BxSxD, cfg)
  return entries, _selected(params, x_BxSxD, q_residual_BxSxR, positions_BxS, keys, visible_SxT, cfg)


def empty_cache(cfg, batch: int, max_length: int, dtype=jnp.float32) -> dict:
  """The compressors' cache before any token, per series: `{prefix}kv` and `{prefix}gate` [B, (1 + P) m, C] (slot
  j: the token (1 + P) m - j back; zeros before the first) and `{prefix}entries` [B, max_length // m, width]."""
  cache, m, p = {}, cfg.compress_rate, _overlap(cfg)
  for prefix, width in _series(cfg):
    tail = jnp.zeros((batch, (1 + p) * m, (1 + p) * width), dtype)
    cache.update({f"{prefix}kv": tail, f"{prefix}gate": tail})
    cache[f"{prefix}entries"] = jnp.zeros((batch, max_length // m, width), dtype)
  return cache


def _step_series(params, prefix: str, width: int, x_BxSxD, cache: dict, cfg) -> dict:
  """One series' cache after the S new tokens: the windows they close pooled into their entry slots."""
  m, p, length, s = cfg.compress_rate, _overlap(cfg), cache["length"], x_BxSxD.shape[1]
  project = lambda name: linear(x_BxSxD, params[f"{prefix}{name}_proj.weight"]).astype(cache[f"{prefix}kv"].dtype)
  kv = jnp.concatenate([cache[f"{prefix}kv"], project("kv")], axis=1)
  gate = jnp.concatenate([cache[f"{prefix}gate"], project("gate")], axis=1)
  n = -(-s // m)  # the most windows S tokens can close; which ones they are depends on the traced length
  pad = jnp.zeros((kv.shape[0], n * m - s, kv.shape[2]), kv.dtype)
  # buffer slot i holds token length - (1 + P) m + i, so window length // m - P starts at m - length % m
  take = lambda a: jax.lax.dynamic_slice_in_dim(jnp.concatenate([a, pad], 1), m - length % m, (n + p) * m, axis=1)
  fresh = _pool(params, prefix, take(kv), take(gate), length // m, width, cfg)
  slots = length // m + jnp.arange(n)
  entries = cache[f"{prefix}entries"]
  slots = jnp.where(slots < (length + s) // m, slots, entries.shape[1])  # windows still open: dropped
  entries = entries.at[:, slots].set(fresh.astype(entries.dtype), mode="drop")
  keep = (1 + p) * m
  return {f"{prefix}kv": kv[:, -keep:], f"{prefix}gate": gate[:, -keep:], f"{prefix}entries": entries}


def decode(params, x_BxSxD, q_residual_BxSxR, positions_BxS, cache: dict, cfg) -> tuple[jax.Array, jax.Array, dict]:
  """The S tokens after the `cache`'s `length`: -> (entries [B, T, W] (the cache's slots, those not written yet
  hidden), visible [B, S, T], the compressors' cache after them). Entries past max_length // m are dropped."""
  s, updated = x_BxSxD.shape[1], {}
  for prefix, width in _series(cfg):
    updated.update(_step_series(params, prefix, width, x_BxSxD, cache, cfg))
  entries = updated[f"{COMPRESSOR}entries"].astype(x_BxSxD.dtype)
  visible_SxT = _complete(cache["length"] + jnp.arange(s), entries.shape[1], cfg.compress_rate)
  if not _overlap(cfg):
    return entries, jnp.broadcast_to(visible_SxT, (x_BxSxD.shape[0], *visible_SxT.shape)), updated
  keys = updated[f"{INDEXER}entries"].astype(x_BxSxD.dtype)
  return entries, _selected(params, x_BxSxD, q_residual_BxSxR, positions_BxS, keys, visible_SxT, cfg), updated
