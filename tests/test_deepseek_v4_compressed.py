"""DeepSeek-V4's compressed attention layers (HCA and CSA: `deepseek_v4_attention` with `deepseek_v4_compressors`)
against float64 NumPy written here from the formulas (each window's entry pooled slot by slot, the indexer's
scores entry by entry and its top-k by sorting, each query over its window and its entries one key at a time, YaRN's
frequencies from their definition), numerical gradients of that NumPy, and their own decode path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models.mixers import deepseek_v4_attention as dsa
from moejax.validation import ConfigError
from tests.test_deepseek_v4_attention import SHAPES, assert_close, check_central_differences, f32, np_rms, random_params

decode = jax.jit(dsa.decode, static_argnames="cfg")
B, S = 2, 22  # HCA: 5 entries and 2 tokens left over; CSA: 7 entries, 1 left over
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
KINDS = ("heavily_compressed_attention", "compressed_sparse_attention")


def config(kind: str) -> dsa.DeepseekV4AttentionConfig:
  """Window 4 < S, so the entries matter; YaRN with an attention factor (checkpoints force 1) to exercise it."""
  rope = tuple(sorted({**YARN, "attention_factor": 1.3}.items()))
  common = dict(**SHAPES, sliding_window=4, rope_theta=50.0, compress_rope_theta=160.0, compress_rope=rope)
  if kind == "heavily_compressed_attention":
    return dsa.DeepseekV4AttentionConfig(**common, layer_type=kind, compress_rate=4)
  index = dict(index_num_heads=4, index_head_dim=6, index_topk=3)  # top 3 of up to 7 entries
  return dsa.DeepseekV4AttentionConfig(**common, layer_type=kind, compress_rate=3, **index)


def inputs(seed: int = 1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, S, SHAPES["hidden_size"]))
  return x, np.arange(S)[None, :] + np.array([[0], [7]])  # queries' RoPE positions need not start at 0


def np_yarn(dim, theta, factor, original, beta_fast, beta_slow):
  """YaRN's inverse frequencies: pair i's theta^(-2i / dim), divided by factor past the ramp from the dims of
  beta_fast rotations (kept) to beta_slow's (divided) over original positions."""
  dim_of = lambda rotations: dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(theta))
  low, high = max(np.floor(dim_of(beta_fast)), 0), min(np.ceil(dim_of(beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / (high - low + 0.001 * (high == low)), 0, 1)
  plain = theta ** (-np.arange(0, dim, 2) / dim)
  return plain * (1 - ramp) + plain / factor * ramp


def np_rope(x, positions, cfg, sign=1.0):
  """x [..., W]: the pair (W - R + 2i, W - R + 2i + 1) rotated by sign * position * inverse_i, scaled by 1.3."""
  rope = dict(cfg.compress_rope)
  keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
  inverse = np_yarn(cfg.rope_head_dim, cfg.compress_rope_theta, *(rope[k] for k in keys))
  out, width, r = x.copy(), x.shape[-1], cfg.rope_head_dim
  for i, frequency in enumerate(inverse):
    angle = sign * positions * frequency
    a, b = width - r + 2 * i, width - r + 2 * i + 1
    out[..., a] = rope["attention_factor"] * (x[..., a] * np.cos(angle) - x[..., b] * np.sin(angle))
    out[..., b] = rope["attention_factor"] * (x[..., b] * np.cos(angle) + x[..., a] * np.sin(angle))
  return out


def np_entries(p, prefix, x, cfg, width):
  """[B, S // m, width]: entry w pools its window's tokens (CSA: their last width features, and the previous
  window's first width) by a per-feature softmax of gate + position_bias, RMS-normed, rotated at w m."""
  m, csa = cfg.compress_rate, cfg.layer_type == "compressed_sparse_attention"
  kv, gate, bias = x @ p[prefix + "kv_proj.weight"].T, x @ p[prefix + "gate_proj.weight"].T, p[prefix + "position_bias"]
  out = np.zeros((x.shape[0], x.shape[1] // m, width))
  for w in range(out.shape[1]):
    slots = [(w * m + j, j, slice(-width, None)) for j in range(m)]
    slots += [((w - 1) * m + j, j, slice(0, width)) for j in range(m)] if csa and w > 0 else []
    gates = np.stack([gate[:, t, f] + bias[j, f] for t, j, f in slots], axis=1)
    weights = np.exp(gates) / np.exp(gates).sum(axis=1, keepdims=True)
    out[:, w] = (weights * np.stack([kv[:, t, f] for t, _, f in slots], axis=1)).sum(axis=1)
  out = np_rms(out, p[prefix + "kv_norm.weight"], cfg.rms_eps)
  return np_rope(out, np.arange(out.shape[1]) * m, cfg)


def np_choices(p, x, positions, cfg, q_residual, keys, b, t, complete):
  """The entries query t of row b sees and, CSA, the gap between its k-th and next best scores (inf if none);
  keys: the indexer's entries of row b."""
  if cfg.layer_type != "compressed_sparse_attention":
    return complete, np.inf
  pre, heads, width = "compressor.indexer.", cfg.index_num_heads, cfg.index_head_dim
  q = np_rope((q_residual[b, t] @ p[pre + "q_b_proj.weight"].T).reshape(heads, width), positions[b, t], cfg)
  weights = x[b, t] @ p[pre + "scorer.weights_proj.weight"].T / np.sqrt(heads)
  scores = {w: sum(weights[h] * max(q[h] @ keys[w], 0.0) / np.sqrt(width) for h in range(heads)) for w in complete}
  ranked = sorted(complete, key=lambda w: -scores[w])
  k = cfg.index_topk
  gap = scores[ranked[k - 1]] - scores[ranked[k]] if len(ranked) > k else np.inf
  return ranked[:k], gap


def np_layer(p, x, positions, cfg, gaps=None):
  """The layer in float64, every query of every head over its window's keys and its entries one at a time."""
  b, s, _ = x.shape
  h, w, g, ro, eps, m = cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.rms_eps, cfg.compress_rate
  q_residual = np_rms(x @ p["q_a_proj.weight"].T, p["q_a_norm.weight"], eps)
  q = np_rope(np_rms((q_residual @ p["q_b_proj.weight"].T).reshape(b, s, h, w), None, eps), positions[..., None], cfg)
  kv = np_rope(np_rms(x @ p["kv_proj.weight"].T, p["kv_norm.weight"], eps), positions, cfg)
  entries = np_entries(p, "compressor.", x, cfg, w)
  csa = cfg.layer_type == "compressed_sparse_attention"
  index_keys = np_entries(p, "compressor.indexer.", x, cfg, cfg.index_head_dim) if csa else [None] * b
  o = np.zeros((b, s, h, w))
  for i in range(b):
    for t in range(s):
      complete = [e for e in range(s // m) if (e + 1) * m <= t + 1]
      chosen, gap = np_choices(p, x, positions, cfg, q_residual, index_keys[i], i, t, complete)
      if gaps is not None:
        gaps.append(gap)
      keys = [kv[i, u] for u in range(max(0, t - cfg.sliding_window + 1), t + 1)] + [entries[i, e] for e in chosen]
      for j in range(h):
        logits = np.array([q[i, t, j] @ key / np.sqrt(w) for key in keys])
        weights = np.exp(logits) / (np.exp(logits).sum() + np.exp(p["sinks"][j]))
        o[i, t, j] = sum(wt * key for wt, key in zip(weights, keys))
  o = np_rope(o, positions[..., None], cfg, sign=-1.0).reshape(b, s, h * w)
  per_group = h * w // g
  grouped = [
    o[..., k * per_group : (k + 1) * per_group] @ p["o_a_proj.weight"][k * ro : (k + 1) * ro].T for k in range(g)
  ]
  return np.concatenate(grouped, axis=-1) @ p["o_b_proj.weight"].T


@functools.cache
def forward_and_gradients(kind: str):
  """(config, float64 params, x, positions, loss weights, y, d sum(weights * y) / d (x, params)): one compiled
  program per kind for the forward, gradient and decode tests (compiling dominates their time)."""
  cfg = config(kind)
  params, (x, positions) = random_params(cfg), inputs()
  weights = np.random.default_rng(2).standard_normal((B, S, SHAPES["hidden_size"]))

  @jax.jit
  def run(x32, p32):
    y, pullback = jax.vjp(lambda x32, p32: dsa.attend(p32, x32, jnp.asarray(positions), cfg), x32, p32)
    return y, pullback(jnp.asarray(weights, jnp.float32))

  y, grads = run(jnp.asarray(x, jnp.float32), f32(params))
  return cfg, params, x, positions, weights, y, grads


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_numpy(kind):
  cfg, params, x, positions, _, y, _ = forward_and_gradients(kind)
  gaps = []
  expected = np_layer(params, x, positions, cfg, gaps)
  assert_close(y, expected, 1e-5)
  if kind == "compressed_sparse_attention":  # the indexer drops entries, and no near-tie makes float32 choose apart
    assert sum(np.isfinite(gaps)) >= S and min(gaps) > 1e-3, min(gaps)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_numerical(kind):
  cfg, params, x, positions, weights, _, (grad_x, grad_p) = forward_and_gradients(kind)  # loss: sum(weights * y)
  names = ("x", "compressor.kv_proj.weight", "compressor.gate_proj.weight", "compressor.position_bias")
  grads = {name: grad_x if name == "x" else grad_p[name] for name in names}
  check_central_differences(grads, lambda ps, xs: np_layer(ps, xs, positions, cfg), params, x, weights, per=2)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_forward(kind):
  """A 4-token prompt in one call, single tokens, a 4-token piece (closing a window mid-piece), single tokens again
  equal the whole sequence at once; the cache has room for exactly S tokens."""
  cfg, params, x, positions, _, full, _ = forward_and_gradients(kind)
  params, x, positions = f32(params), jnp.asarray(x, jnp.float32), jnp.asarray(positions)
  cache, pieces = dsa.empty_cache(cfg, B, max_length=S), []
  for a, b in [(0, 4), *((t, t + 1) for t in range(4, 13)), (13, 17), *((t, t + 1) for t in range(17, S))]:
    y, cache = decode(params, x[:, a:b], cache, positions[:, a:b], cfg)
    pieces.append(y)
  assert int(cache["length"]) == S and cache["compressor.entries"].shape == (B, S // cfg.compress_rate, 8)
  assert_close(jnp.concatenate(pieces, axis=1), full, 1e-5)


def test_bad_inputs_are_named():
  hca = config(KINDS[0])
  with pytest.raises(ConfigError, match="layer_type='full_attention'.*sliding_attention"):
    dsa.DeepseekV4AttentionConfig(**SHAPES, sliding_window=4, layer_type="full_attention")
  with pytest.raises(ConfigError, match="compress_rate=0.*positive int for heavily_compressed_attention"):
    dsa.DeepseekV4AttentionConfig(**SHAPES, sliding_window=4, layer_type=KINDS[0])
  with pytest.raises(ConfigError, match="compress_rate=4.*0 for a sliding_attention"):
    dsa.DeepseekV4AttentionConfig(**SHAPES, sliding_window=4, compress_rate=4)
  with pytest.raises(ConfigError, match="index_head_dim=2.*rope_head_dim=4"):
    dsa.DeepseekV4AttentionConfig(**{**config(KINDS[1]).__dict__, "index_head_dim": 2})
  with pytest.raises(ConfigError, match="compress_ratios\\[1\\]=64.*one of \\(0, 4, 128\\)"):
    dsa.DeepseekV4AttentionConfig.from_hf({"compress_ratios": [0, 64]}, 1)
  params = f32(random_params(hca))
  params["compressor.position_bias"] = jnp.ones((3, 8))  # a compress rate of 3, not the config's 4
  with pytest.raises(ConfigError, match=r"compressor\.position_bias'\]\.shape=\(3, 8\).*\(4, 8\)"):
    dsa.attend(params, jnp.ones((1, 8, 16)), jnp.arange(8)[None], hca)
  with pytest.raises(ConfigError, match="max_length=None.*heavily_compressed_attention"):
    dsa.empty_cache(hca, 1)


def test_from_hf_reads_the_compressed_fields():
  """layer_types (or legacy compress_ratios) pick the kind; compress_rates, the indexer's fields and the 'compress'
  rope (flat YaRN with compress_rope_theta: attention factor 1, as transformers' config forces) fill it in."""
  hf = {**{k: v for k, v in SHAPES.items() if k not in ("num_heads", "rope_head_dim")}, "num_attention_heads": 4}
  hf.update(qk_rope_head_dim=4, sliding_window=4, rms_norm_eps=1e-6, rope_theta=50.0, compress_rope_theta=160.0)
  hf.update(compress_rates={KINDS[1]: 3, KINDS[0]: 4}, index_n_heads=4, index_head_dim=6, index_topk=3)
  hf.update(layer_types=["sliding_attention", *KINDS], rope_parameters=dict(YARN))
  one = (("attention_factor", 1.0), *((k, v) for k, v in config(KINDS[0]).compress_rope if k != "attention_factor"))
  for layer, kind in ((1, KINDS[0]), (2, KINDS[1])):
    assert dsa.DeepseekV4AttentionConfig.from_hf(hf, layer) == dataclasses.replace(config(kind), compress_rope=one)
  legacy = {k: v for k, v in hf.items() if k != "layer_types"} | {"compress_ratios": [128, 4]}
  assert dsa.DeepseekV4AttentionConfig.from_hf(legacy, 0).compress_rate == 4  # HCA, at this config's rate
  nested = hf | {"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 50.0}, "compress": YARN}}
  assert dict(dsa.DeepseekV4AttentionConfig.from_hf(nested, 1).compress_rope).get("attention_factor") is None
