"""Kimi delta attention (`moejax.models.mixers.kimi_delta`) and the delta rule's per-channel decay
(`moejax.models.mixers.delta_rule`) against float64 NumPy written here: the recurrence token by token with a decay
per key channel, forward and gradient (central differences of that NumPy, and jax.grad of the token-by-token rule in
float64), the scalar gate as the rule's broadcast case, and the whole layer (its projections, convolutions, forget
gate, gated norm) with its decode cache. transformers' layer itself: the kimi_linear fixture (tests/test_hf_kimi_linear.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models.mixers import delta_rule
from moejax.models.mixers import kimi_delta as kda
from moejax.validation import ConfigError
from tests.test_gated_deltanet import assert_close, np_conv, np_l2

mixer = jax.jit(kda.kimi_delta_mixer, static_argnames="cfg")
CFG = kda.KimiDeltaConfig(hidden_size=12, num_heads=3, head_dim=6, chunk=4)


def np_kda_rule(q, k, v, g, beta, state=None):
  """Per token, batch row and head, in float64: S <- diag(exp(g)) S (row i of S by exp(g[i])), then
  S <- S + beta k (v - S^T k)^T, o = S^T q / sqrt(K) (transformers' `recurrent_kimi_delta_attention`)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, s, h, vd = v.shape
  kd = k.shape[-1]
  st = np.zeros((b, h, kd, vd)) if state is None else np.array(state, np.float64)
  o = np.zeros((b, s, h, vd))
  for t in range(s):
    for i in range(b):
      for j in range(h):
        st[i, j] *= np.exp(g[i, t, j])[:, None]
        st[i, j] += beta[i, t, j] * np.outer(k[i, t, j], v[i, t, j] - st[i, j].T @ k[i, t, j])
        o[i, t, j] = st[i, j].T @ (q[i, t, j] / np.sqrt(kd))
  return o, st


def rule_inputs(seed, b=2, s=11, h=3, kd=6, vd=5, g_range=(0.02, 1.5)):
  """Random inputs: k L2-normalised, a log decay per key channel in -g_range, beta in (0.05, 0.95), a state."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(b, s, h, kd))
  return tuple(
    x.astype(np.float32)
    for x in (
      rng.normal(size=(b, s, h, kd)),
      k / np.linalg.norm(k, axis=-1, keepdims=True),
      rng.normal(size=(b, s, h, vd)),
      -rng.uniform(*g_range, size=(b, s, h, kd)),
      rng.uniform(0.05, 0.95, size=(b, s, h)),
      0.5 * rng.normal(size=(b, h, kd, vd)),
    )
  )


@pytest.mark.slow
def test_per_channel_rule_forward_and_gradient_equal_float64_numpy():
  """The chunked rule with a decay per key channel (a tail chunk, strong decays to exp(-60) too) and the recurrent
  step against the NumPy recurrence; in float64 exact to 1e-12; its gradient against central differences of the
  NumPy on 3 coordinates of each input, and the whole gradient against jax.grad of the float64 recurrent rule."""
  chunked = jax.jit(delta_rule.chunked_gated_delta_rule, static_argnames="chunk")
  q, k, v, g, beta, state = rule_inputs(1)
  for rule in (lambda *xs, **kw: chunked(*xs, chunk=4, **kw), delta_rule.recurrent_gated_delta_rule):
    o, final = rule(q, k, v, g, beta, initial_state=state)
    o_ref, final_ref = np_kda_rule(q, k, v, g, beta, state)
    assert_close(o, o_ref, 1e-5)
    assert_close(final, final_ref, 1e-5)
  strong = rule_inputs(2, s=8, g_range=(0.0, 60.0))
  o, final = chunked(*strong[:5], chunk=4, initial_state=strong[5])
  assert_close(o, np_kda_rule(*strong)[0], 1e-5)
  with jax.enable_x64(True):
    o, final = chunked(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta)), chunk=4)
  assert o.dtype == jnp.float64
  assert_close(o, np_kda_rule(q, k, v, g, beta)[0], 1e-12)

  rng = np.random.default_rng(3)
  w_o, w_s = rng.normal(size=v.shape), rng.normal(size=state.shape)

  def loss(rule, *xs):
    o, final = rule(*xs, initial_state=jnp.asarray(state, xs[0].dtype))
    return jnp.sum(o * w_o) + jnp.sum(final * w_s)

  grads = jax.jit(jax.grad(lambda *xs: loss(lambda *a, **kw: chunked(*a, chunk=4, **kw), *xs), argnums=range(5)))(
    q, k, v, g, beta
  )
  with jax.enable_x64(True):
    xs64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta)]
    grads64 = jax.grad(lambda *xs: loss(delta_rule.recurrent_gated_delta_rule, *xs), argnums=range(5))(*xs64)
  for grad, grad64 in zip(grads, grads64):
    assert_close(grad, grad64, 2e-5)
  inputs, eps = [np.asarray(x, np.float64) for x in (q, k, v, g, beta)], 1e-6
  for arg, (x, grad) in enumerate(zip(inputs, grads)):
    for _ in range(3):
      idx = tuple(rng.integers(n) for n in x.shape)
      shifted = []
      for sign in (1, -1):
        xs = list(inputs)
        xs[arg] = x.copy()
        xs[arg][idx] += sign * eps
        o, final = np_kda_rule(*xs, state)
        shifted.append(np.sum(o * w_o) + np.sum(final * w_s))
      numeric = (shifted[0] - shifted[1]) / (2 * eps)
      assert abs(grad[idx] - numeric) <= 1e-4 * np.abs(grad).max(), (arg, idx, grad[idx], numeric)


def test_scalar_gate_is_the_broadcast_case():
  """A decay per head (Qwen3-Next's g [B, S, H]) gives what the same decay on every key channel gives."""
  q, k, v, g, beta, state = rule_inputs(4)
  g_head = g[..., 0]
  per_head = delta_rule.chunked_gated_delta_rule(q, k, v, g_head, beta, chunk=4, initial_state=state)
  broadcast = np.repeat(g_head[..., None], k.shape[-1], axis=-1)
  per_channel = delta_rule.chunked_gated_delta_rule(q, k, v, broadcast, beta, chunk=4, initial_state=state)
  for a, b in zip(per_head, per_channel):
    assert_close(a, b, 1e-6)


def random_params(seed, cfg=CFG):
  """A KDA layer's tensors (float32, the checkpoints' shapes)."""
  rng = np.random.default_rng(seed)
  d, h, kd, w = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.width
  shapes = {
    **{f"{p}_proj.weight": (w, d) for p in "qkv"},
    **{f"{p}_conv1d.weight": (w, 1, cfg.conv_kernel) for p in "qkv"},
    "f_a_proj.weight": (kd, d),
    "f_b_proj.weight": (w, kd),
    "b_proj.weight": (h, d),
    "g_a_proj.weight": (kd, d),
    "g_b_proj.weight": (w, kd),
    "o_proj.weight": (d, w),
  }
  params = {name: 0.4 * rng.normal(size=shape) for name, shape in shapes.items()}
  params |= {"A_log": np.log(rng.uniform(0.5, 4, (1, 1, h, 1))), "dt_bias": rng.normal(size=w)}
  params["o_norm.weight"] = 1 + 0.2 * rng.normal(size=kd)
  return {name: t.astype(np.float32) for name, t in params.items()}


def np_layer(p, x, cfg, mask=None):
  """The whole layer in float64, as transformers' `KimiLinearDeltaAttention.forward` reads."""
  p = {name: np.asarray(t, np.float64) for name, t in p.items()}
  x = np.asarray(x, np.float64) * (1 if mask is None else np.asarray(mask)[..., None])
  b, s, _ = x.shape
  heads = lambda t: t.reshape(b, s, cfg.num_heads, cfg.head_dim)
  q, k, v = (np_conv(x @ p[f"{n}_proj.weight"].T, p[f"{n}_conv1d.weight"][:, 0]) for n in "qkv")
  q, k, v = np_l2(heads(q)), np_l2(heads(k)), heads(v)
  f = heads(x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"])
  g = -np.exp(p["A_log"]) * np.log1p(np.exp(f))
  beta = 1 / (1 + np.exp(-(x @ p["b_proj.weight"].T)))
  o, _ = np_kda_rule(q, k, v, g, beta)
  gate = heads(x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T)
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + cfg.rms_eps) * p["o_norm.weight"] / (1 + np.exp(-gate))
  return o.reshape(b, s, -1) @ p["o_proj.weight"].T


def test_layer_equals_numpy_and_decodes_as_its_forward():
  """The layer (with left padding masked too) against NumPy; a 6-token prefill, 3 single tokens (the recurrent rule,
  the convolution's update) and a 2-token piece with the cache equal the 11-token forward, state and all."""
  params = random_params(5)
  x = np.random.default_rng(6).normal(size=(2, 11, CFG.hidden_size)).astype(np.float32)
  mask = np.ones((2, 11), np.float32)
  mask[1, :3] = 0
  full, full_cache = mixer(params, jnp.asarray(x), cfg=CFG)
  assert_close(full, np_layer(params, x, CFG), 1e-5)
  y_masked, _ = mixer(params, jnp.asarray(x), cfg=CFG, mask_BxS=jnp.asarray(mask))
  assert_close(y_masked, np_layer(params, x, CFG, mask), 1e-5)
  y, cache = mixer(params, jnp.asarray(x[:, :6]), cfg=CFG, cache=kda.empty_cache(CFG, 2))
  pieces = [y]
  for lo, hi in [(6, 7), (7, 8), (8, 9), (9, 11)]:
    y, cache = mixer(params, jnp.asarray(x[:, lo:hi]), cfg=CFG, cache=cache)
    pieces.append(y)
  assert_close(jnp.concatenate(pieces, axis=1), full, 1e-5)
  assert_close(cache["recurrent"], full_cache["recurrent"], 1e-5)
  np.testing.assert_array_equal(cache["conv"], full_cache["conv"])


def test_config_from_hf():
  """transformers' linear_* fields, or the published checkpoints' linear_attn_config."""
  hf = {"hidden_size": 12, "linear_num_heads": 3, "linear_head_dim": 6, "linear_conv_kernel_dim": 4}
  assert kda.KimiDeltaConfig.from_hf(hf) == kda.KimiDeltaConfig(12, 3, 6, 4, 1e-5)
  published = {"hidden_size": 12, "linear_attn_config": {"num_heads": 3, "head_dim": 6, "short_conv_kernel_size": 4}}
  assert kda.KimiDeltaConfig.from_hf(published) == kda.KimiDeltaConfig(12, 3, 6, 4, 1e-5)
  with pytest.raises(ConfigError, match="head_dim"):
    kda.KimiDeltaConfig(12, 3, 0)
