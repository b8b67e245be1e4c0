"""The gated DeltaNet mixer (`moejax.models.mixers`) against float64 NumPy written here (the recurrence token by
token, the convolution as a loop, the layer with its projections read group by group), numerical gradients of that
NumPy, and transformers' own layers (tests/data/mixers, written by tests/fixtures/make_mixer_fixtures.py)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from moejax.models.mixers import delta_rule
from moejax.models.mixers import gated_deltanet as gdn
from moejax.validation import ConfigError

DATA = pathlib.Path(__file__).resolve().parent / "data" / "mixers" / "gated_deltanet"
# jitted: one compilation per shape instead of one per eager op (the decode steps share theirs)
mixer = jax.jit(gdn.gated_deltanet_mixer, static_argnames="cfg")
CFG = gdn.GatedDeltaNetConfig(hidden_size=12, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, chunk=4)


def assert_close(actual, expected, rtol):
  """Every entry within rtol of the largest |expected| (entries near zero are not held to a relative bound)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  err = np.abs(actual - expected).max() / np.abs(expected).max()
  assert err <= rtol, f"max error {err:.2e} relative to the largest entry, allowed {rtol:.0e}"


def silu(x):
  return x / (1 + np.exp(-x))


def np_l2(x):
  return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def np_delta_rule(q, k, v, g, beta, state=None):
  """The paper's recurrence per token, batch row and value head, in float64: S <- exp(g) S, then
  S <- S + beta k (v - S^T k)^T, o = S^T q / sqrt(K); value head j reads key head j // (H / Hk)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, s, h, vd = v.shape
  kd, rep = k.shape[-1], h // k.shape[2]
  st = np.zeros((b, h, kd, vd)) if state is None else np.array(state, np.float64)
  o = np.zeros((b, s, h, vd))
  for t in range(s):
    for i in range(b):
      for j in range(h):
        k_t, q_t = k[i, t, j // rep], q[i, t, j // rep] / np.sqrt(kd)
        st[i, j] *= np.exp(g[i, t, j])
        st[i, j] += beta[i, t, j] * np.outer(k_t, v[i, t, j] - st[i, j].T @ k_t)
        o[i, t, j] = st[i, j].T @ q_t
  return o, st


def np_conv(x, w_CxW, state=None):
  """y[t, c] = silu(sum_j w[c, j] x[t - W + 1 + j, c]), inputs before the first from state [B, W - 1, C]."""
  x = np.asarray(x, np.float64)
  b, s, c = x.shape
  width = w_CxW.shape[1]
  state = np.zeros((b, width - 1, c)) if state is None else np.asarray(state, np.float64)
  y = np.zeros_like(x)
  for t in range(s):
    for j in range(width):
      src = t - (width - 1) + j
      y[:, t] += w_CxW[:, j] * (x[:, src] if src >= 0 else state[:, width - 1 + src])
  return silu(y)


def np_gated_norm(x, z, w, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w * silu(z)


def np_projections(p, x, cfg):
  """q, k [B, S, Hk, K], v, z [B, S, H, V], b, a [B, S, H]: Qwen3-Next's rows read group by group (rows
  g * G .. of group g: its q, its k, its r heads' v, their z; in_proj_ba: its r b, its r a), or Qwen3.5's."""
  hk, h, kd, vd = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
  r = h // hk
  if "in_proj_qkv.weight" in p:
    qkv = x @ p["in_proj_qkv.weight"].T
    q, k = qkv[..., : hk * kd], qkv[..., hk * kd : 2 * hk * kd]
    v = qkv[..., 2 * hk * kd :].reshape(*x.shape[:2], h, vd)
    z = (x @ p["in_proj_z.weight"].T).reshape(*x.shape[:2], h, vd)
    return (
      q.reshape(*x.shape[:2], hk, kd),
      k.reshape(*x.shape[:2], hk, kd),
      v,
      z,
      x @ p["in_proj_b.weight"].T,
      x @ p["in_proj_a.weight"].T,
    )
  w, w_ba, big = p["in_proj_qkvz.weight"], p["in_proj_ba.weight"], 2 * kd + 2 * r * vd
  q = np.stack([x @ w[i * big : i * big + kd].T for i in range(hk)], axis=2)
  k = np.stack([x @ w[i * big + kd : i * big + 2 * kd].T for i in range(hk)], axis=2)
  v, z, b, a = [], [], [], []
  for j in range(h):
    i, m = divmod(j, r)
    v.append(x @ w[i * big + 2 * kd + m * vd :][:vd].T)
    z.append(x @ w[i * big + 2 * kd + r * vd + m * vd :][:vd].T)
    b.append(x @ w_ba[i * 2 * r + m])
    a.append(x @ w_ba[i * 2 * r + r + m])
  return q, k, np.stack(v, 2), np.stack(z, 2), np.stack(b, -1), np.stack(a, -1)


def np_mixer(p, x, cfg, mask=None):
  """The whole layer in float64, as transformers' forward reads."""
  p = {name: np.asarray(t, np.float64) for name, t in p.items()}
  x = np.asarray(x, np.float64) * (1 if mask is None else np.asarray(mask)[..., None])
  q, k, v, z, b, a = np_projections(p, x, cfg)
  bsz, s = x.shape[:2]
  channels = np.concatenate([q.reshape(bsz, s, -1), k.reshape(bsz, s, -1), v.reshape(bsz, s, -1)], -1)
  conv = np_conv(channels, p["conv1d.weight"][:, 0])
  kdim = cfg.num_k_heads * cfg.head_k_dim
  q = np_l2(conv[..., :kdim].reshape(q.shape))
  k = np_l2(conv[..., kdim : 2 * kdim].reshape(k.shape))
  v = conv[..., 2 * kdim :].reshape(v.shape)
  g = -np.exp(p["A_log"]) * np.log1p(np.exp(a + p["dt_bias"]))
  o, _ = np_delta_rule(q, k, v, g, 1 / (1 + np.exp(-b)), None)
  o = np_gated_norm(o, z, p["norm.weight"], cfg.rms_eps)
  return o.reshape(bsz, s, -1) @ p["out_proj.weight"].T


def rule_inputs(seed, b=2, s=13, hk=2, h=4, kd=8, vd=6, g_range=(0.02, 1.5)):
  """Random rule inputs, float32 as the layer gives them: k L2-normalised (so the recurrence is a contraction),
  decays exp(g) from ~0.2 to ~1, beta in (0.05, 0.95), a random initial state."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, s, hk, kd))
  return tuple(
    x.astype(np.float32)
    for x in (
      rng.normal(size=(b, s, hk, kd)),
      k / np.linalg.norm(k, axis=-1, keepdims=True),
      rng.normal(size=(b, s, h, vd)),
      -rng.uniform(*g_range, size=(b, s, h)),
      rng.uniform(0.05, 0.95, size=(b, s, h)),
      0.5 * rng.normal(size=(b, h, kd, vd)),
    )
  )


@pytest.mark.parametrize("s,chunk,hk", [(13, 4, 2), (5, 64, 4), (16, 8, 1)], ids=["tail", "short", "mqa"])
def test_chunked_rule_equals_numpy_recurrence(s, chunk, hk):
  q, k, v, g, beta, state = rule_inputs(s, s=s, hk=hk)
  o, final = delta_rule.chunked_gated_delta_rule(q, k, v, g, beta, chunk=chunk, initial_state=state)
  o_ref, final_ref = np_delta_rule(q, k, v, g, beta, state)
  assert o.dtype == jnp.float32 and final.dtype == jnp.float32
  assert_close(o, o_ref, 1e-5)
  assert_close(final, final_ref, 1e-5)


def test_recurrent_rule_equals_numpy_recurrence():
  q, k, v, g, beta, state = rule_inputs(1, s=7)
  o, final = delta_rule.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
  o_ref, final_ref = np_delta_rule(q, k, v, g, beta, state)
  assert_close(o, o_ref, 1e-5)
  assert_close(final, final_ref, 1e-5)


def test_chunked_rule_in_float64_is_exact():
  """The chunked form is the recurrence rewritten, not an approximation: in float64 it agrees to 1e-12."""
  inputs = rule_inputs(2, s=11)
  with jax.enable_x64(True):
    o, final = delta_rule.chunked_gated_delta_rule(*(jnp.asarray(x, jnp.float64) for x in inputs[:5]), chunk=4)
    assert o.dtype == jnp.float64
  o_ref, final_ref = np_delta_rule(*inputs[:5])
  assert_close(o, o_ref, 1e-12)
  assert_close(final, final_ref, 1e-12)


def test_strong_decays_stay_finite():
  """Decays to exp(-60) per token: the chunk's cumulative decays underflow to 0 and nothing overflows."""
  q, k, v, g, beta, state = rule_inputs(3, s=12, g_range=(0.0, 60.0))
  o, final = delta_rule.chunked_gated_delta_rule(q, k, v, g, beta, chunk=8, initial_state=state)
  grads = jax.jit(
    jax.grad(lambda *xs: delta_rule.chunked_gated_delta_rule(*xs, chunk=8)[0].sum(), argnums=(0, 1, 2, 3, 4))
  )
  assert all(np.isfinite(x).all() for x in grads(q, k, v, g, beta))
  o_ref, final_ref = np_delta_rule(q, k, v, g, beta, state)
  assert_close(o, o_ref, 1e-5)
  assert_close(final, final_ref, 1e-5)


def _loss_weights(seed, shapes):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=shape) for shape in shapes]


def test_chunked_gradient_equals_numerical_gradient_of_numpy():
  """d(sum(w_o o) + sum(w_s final)) / d(q, k, v, g, beta) of the chunked rule against central differences of the
  float64 NumPy recurrence, on 3 random coordinates of each input."""
  q, k, v, g, beta, state = rule_inputs(4, b=1, s=9)
  w_o, w_s = _loss_weights(5, [(1, 9, 4, 6), state.shape])

  def loss_jax(*xs):
    o, final = delta_rule.chunked_gated_delta_rule(*xs, chunk=4, initial_state=state)
    return jnp.sum(o * w_o) + jnp.sum(final * w_s)

  def loss_np(*xs):
    o, final = np_delta_rule(*xs, state)
    return np.sum(o * w_o) + np.sum(final * w_s)

  inputs = [np.asarray(x, np.float64) for x in (q, k, v, g, beta)]
  grads = jax.jit(jax.grad(loss_jax, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
  rng, eps = np.random.default_rng(6), 1e-6
  for arg, (x, grad) in enumerate(zip(inputs, grads)):
    for _ in range(3):
      idx = tuple(rng.integers(n) for n in x.shape)
      plus, minus = [list(inputs) for _ in range(2)]
      plus[arg], minus[arg] = x.copy(), x.copy()
      plus[arg][idx] += eps
      minus[arg][idx] -= eps
      numeric = (loss_np(*plus) - loss_np(*minus)) / (2 * eps)
      assert abs(grad[idx] - numeric) <= 1e-4 * np.abs(grad).max(), (arg, idx, grad[idx], numeric)


def test_chunked_gradient_equals_float64_recurrent_gradient():
  """The whole gradient of the chunked rule (float32) against jax.grad of the token-by-token rule in float64."""
  q, k, v, g, beta, state = rule_inputs(7, s=10)
  w_o, w_s = _loss_weights(8, [(2, 10, 4, 6), state.shape])

  def loss(rule, *xs):
    o, final = rule(*xs, initial_state=jnp.asarray(state, xs[0].dtype))
    return jnp.sum(o * w_o) + jnp.sum(final * w_s)

  chunked = lambda *xs, initial_state: delta_rule.chunked_gated_delta_rule(*xs, chunk=4, initial_state=initial_state)
  grads = jax.jit(jax.grad(lambda *xs: loss(chunked, *xs), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
  with jax.enable_x64(True):
    xs64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta)]
    recurrent = delta_rule.recurrent_gated_delta_rule
    grads64 = jax.jit(jax.grad(lambda *xs: loss(recurrent, *xs), argnums=(0, 1, 2, 3, 4)))(*xs64)
    assert grads64[0].dtype == jnp.float64
  for grad, grad64 in zip(grads, grads64):
    assert_close(grad, grad64, 2e-5)


def test_conv_and_its_updates_equal_numpy_loop():
  """The whole sequence at once, and as a 5-token piece, single tokens and a 3-token piece carrying the state."""
  rng = np.random.default_rng(9)
  x, w = rng.normal(size=(2, 10, 7)).astype(np.float32), rng.normal(size=(7, 4)).astype(np.float32)
  y, state = gdn.causal_conv1d(jnp.asarray(x), jnp.asarray(w))
  assert_close(y, np_conv(x, w), 1e-6)
  np.testing.assert_array_equal(state, x[:, -3:])
  pieces, state = [], None
  for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 10)]:
    y_piece, state = gdn.causal_conv1d(jnp.asarray(x[:, lo:hi]), jnp.asarray(w), state)
    pieces.append(y_piece)
  assert_close(jnp.concatenate(pieces, axis=1), np_conv(x, w), 1e-6)
  short, short_state = gdn.causal_conv1d(jnp.asarray(x[:, :2]), jnp.asarray(w))  # fewer tokens than the kernel
  assert_close(short, np_conv(x[:, :2], w), 1e-6)
  np.testing.assert_array_equal(short_state, np.concatenate([np.zeros((2, 1, 7), np.float32), x[:, :2]], 1))


def test_gated_rms_norm_equals_numpy():
  rng = np.random.default_rng(10)
  x, z, w = rng.normal(size=(3, 5, 6)), rng.normal(size=(3, 5, 6)), rng.normal(size=6)
  y = gdn.gated_rms_norm(*(jnp.asarray(t, jnp.float32) for t in (x, z, w)), 1e-6)
  assert_close(y, np_gated_norm(x, z, w, 1e-6), 1e-6)


def random_params(seed, cfg=CFG):
  """A Qwen3-Next layer's tensors (float32, transformers' shapes), decays varying by head."""
  rng = np.random.default_rng(seed)
  d, h = cfg.hidden_size, cfg.num_v_heads
  shapes = {
    "in_proj_qkvz.weight": (2 * cfg.key_dim + 2 * cfg.value_dim, d),
    "in_proj_ba.weight": (2 * h, d),
    "conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
    "out_proj.weight": (d, cfg.value_dim),
  }
  params = {name: 0.4 * rng.normal(size=shape) for name, shape in shapes.items()}
  params |= {"A_log": np.log(rng.uniform(0.5, 4, h)), "dt_bias": rng.normal(size=h)}
  params["norm.weight"] = 1 + 0.2 * rng.normal(size=cfg.head_v_dim)
  return {name: t.astype(np.float32) for name, t in params.items()}


def as_qwen3_5(p, cfg=CFG):
  """The same layer under Qwen3.5-MoE's separate projections: Qwen3-Next's rows regrouped here by index."""
  kd, vd, r, hk = cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads, cfg.num_k_heads
  groups = p["in_proj_qkvz.weight"].reshape(hk, 2 * kd + 2 * r * vd, -1)
  ba = p["in_proj_ba.weight"].reshape(hk, 2 * r, -1)
  q, k, v, z = groups[:, :kd], groups[:, kd : 2 * kd], groups[:, 2 * kd : 2 * kd + r * vd], groups[:, 2 * kd + r * vd :]
  rest = {name: t for name, t in p.items() if not name.startswith("in_proj")}
  return rest | {
    "in_proj_qkv.weight": np.concatenate([t.reshape(-1, t.shape[-1]) for t in (q, k, v)]),
    "in_proj_z.weight": z.reshape(-1, z.shape[-1]),
    "in_proj_b.weight": ba[:, :r].reshape(-1, ba.shape[-1]),
    "in_proj_a.weight": ba[:, r:].reshape(-1, ba.shape[-1]),
  }


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_moe"])
def test_mixer_equals_numpy_layer(layout):
  params = random_params(11)
  params = as_qwen3_5(params) if layout == "qwen3_5_moe" else params
  x = np.random.default_rng(12).normal(size=(2, 11, CFG.hidden_size)).astype(np.float32)
  mask = np.ones((2, 11), np.float32)
  mask[1, :3] = 0  # left padding
  y, _ = mixer(params, jnp.asarray(x), cfg=CFG)
  assert_close(y, np_mixer(params, x, CFG), 1e-5)
  y_masked, _ = mixer(params, jnp.asarray(x), cfg=CFG, mask_BxS=jnp.asarray(mask))
  assert_close(y_masked, np_mixer(params, x, CFG, mask), 1e-5)


def test_mixer_prefill_then_decode_equals_full_forward():
  """A 6-token prefill, 3 single tokens (the recurrent rule, the conv update) and a 3-token piece with the cache
  equal the 12-token forward; a prefill from `empty_cache` equals one without a cache."""
  params = random_params(13)
  x = jnp.asarray(np.random.default_rng(14).normal(size=(2, 12, CFG.hidden_size)), jnp.float32)
  full, full_cache = mixer(params, x, cfg=CFG)
  y, cache = mixer(params, x[:, :6], cfg=CFG)
  from_empty, _ = mixer(params, x[:, :6], cfg=CFG, cache=gdn.empty_cache(CFG, 2))
  assert_close(from_empty, y, 1e-6)
  pieces = [y]
  for lo, hi in [(6, 7), (7, 8), (8, 9), (9, 12)]:
    y, cache = mixer(params, x[:, lo:hi], cfg=CFG, cache=cache)
    pieces.append(y)
  assert_close(jnp.concatenate(pieces, axis=1), full, 1e-5)
  assert_close(cache["recurrent"], full_cache["recurrent"], 1e-5)
  np.testing.assert_array_equal(cache["conv"], full_cache["conv"])


def _fixture(name):
  path = DATA / name
  cfg = gdn.GatedDeltaNetConfig.from_hf(json.loads((path / "config.json").read_text()))
  return cfg, load_file(path / "layer.safetensors"), np.load(path / "reference.npz")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_mixer_equals_transformers(name):
  """transformers' layer on 70 tokens (two of its 64-token chunks): uncached, a 66-token prefill then 4 decoded
  tokens with its cache (and the cache's states), and with padding masked."""
  cfg, params, ref = _fixture(name)
  x = jnp.asarray(ref["x"])
  y, _ = mixer(params, x, cfg=cfg)
  assert_close(y, ref["y"], 1e-5)
  pieces = []
  y, cache = mixer(params, x[:, :66], cfg=cfg)
  pieces.append(y)
  for t in range(66, 70):
    y, cache = mixer(params, x[:, t : t + 1], cfg=cfg, cache=cache)
    pieces.append(y)
  assert_close(jnp.concatenate(pieces, axis=1), ref["y_cached"], 1e-5)
  assert_close(cache["recurrent"], ref["recurrent_state"], 1e-5)
  # transformers keeps the last `kernel` inputs channels-first; moejax the last kernel - 1, channels-last
  assert_close(cache["conv"], ref["conv_state"][..., 1:].transpose(0, 2, 1), 1e-6)
  y_masked, _ = mixer(params, x, cfg=cfg, mask_BxS=jnp.asarray(ref["mask"]))
  assert_close(y_masked, ref["y_masked"], 1e-5)


def test_config_from_hf():
  cfg, _, _ = _fixture("qwen3_next")
  assert cfg == gdn.GatedDeltaNetConfig(16, 2, 4, 8, 6, conv_kernel=4, rms_eps=1e-6)
  text = json.loads((DATA / "qwen3_5_moe" / "config.json").read_text())
  assert gdn.GatedDeltaNetConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": text}) == cfg
  with pytest.raises(ConfigError, match="num_v_heads=3"):
    gdn.GatedDeltaNetConfig(16, 2, 3, 8, 6)
  with pytest.raises(ConfigError, match="hidden_act='gelu'"):
    gdn.GatedDeltaNetConfig.from_hf(text | {"hidden_act": "gelu"})
