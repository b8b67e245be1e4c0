"""DeepSeek-V4's hyper-connections (`moejax.models.mixers.hyper_connections`) against float64 NumPy written here from
transformers' formulas (`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`, the merge in `DeepseekV4DecoderLayer`):
the mixing weights with their Sinkhorn projection, a whole hyper-connected block, the head, gradients against
central differences of that NumPy, dtypes, and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models.mixers import hyper_connections as hc
from moejax.validation import ConfigError
from tests.test_gated_deltanet import assert_close

mixing = jax.jit(hc.mixing_weights, static_argnames="cfg")
head = jax.jit(hc.hyper_head, static_argnames="cfg")
merge = jax.jit(hc.merge)
# (batch, seq, hidden, config): 4 streams with transformers' 20 iterations and with 1, 2 streams with 3
SHAPES = [
  (2, 3, 8, hc.HyperConnectionConfig(hc_mult=4, sinkhorn_iters=20)),
  (1, 5, 6, hc.HyperConnectionConfig(hc_mult=4, sinkhorn_iters=1, hc_eps=1e-3)),
  (2, 2, 5, hc.HyperConnectionConfig(hc_mult=2, sinkhorn_iters=3, rms_eps=1e-5)),
]


def sigmoid(x):
  return 1 / (1 + np.exp(-x))


def random_params(rng, n, d):
  """Weights that spread the logits over a few units, so the sigmoids and the softmax are far from uniform
  (transformers' init, std 0.02, would leave them nearly so) yet no softmax entry is vanishingly small; scales away
  from 1 and a nonzero bias."""
  w, std = (2 + n) * n, 1.5 / np.sqrt(n * d)  # the normed input has unit mean square: logits ~ 1.5 scale
  layer = {"fn": rng.normal(size=(w, n * d)) * std, "base": rng.normal(size=w), "scale": rng.uniform(0.5, 2.0, 3)}
  hd = {"hc_fn": rng.normal(size=(n, n * d)) * std, "hc_base": rng.normal(size=n), "hc_scale": rng.uniform(0.5, 2, 1)}
  return layer, hd


def random_streams(rng, b, s, n, d):
  """Each stream at its own scale, so that collapsing and mixing them is visible."""
  return rng.normal(size=(b, s, n, d)) * rng.uniform(0.5, 3.0, size=(1, 1, n, 1))


def np_normed_flat(h, rms_eps):
  b, s, n, d = h.shape
  x = h.reshape(b, s, n * d)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + rms_eps)


def np_sinkhorn(logits_NxN, iters, eps):
  """Per matrix: a row softmax plus eps, columns normalised, then iters - 1 rounds of rows then columns."""
  m = np.exp(logits_NxN - logits_NxN.max())
  m = m / m.sum(1, keepdims=True) + eps
  m = m / (m.sum(0, keepdims=True) + eps)
  for _ in range(iters - 1):
    m = m / (m.sum(1, keepdims=True) + eps)
    m = m / (m.sum(0, keepdims=True) + eps)
  return m


def np_mixing(p, h, cfg):
  """(pre, post, comb, collapsed) token by token in float64."""
  b, s, n, _ = h.shape
  m = np_normed_flat(h, cfg.rms_eps) @ p["fn"].T
  pre, post, comb = np.zeros((b, s, n)), np.zeros((b, s, n)), np.zeros((b, s, n, n))
  for i in range(b):
    for t in range(s):
      pre[i, t] = sigmoid(m[i, t, :n] * p["scale"][0] + p["base"][:n]) + cfg.hc_eps
      post[i, t] = 2 * sigmoid(m[i, t, n : 2 * n] * p["scale"][1] + p["base"][n : 2 * n])
      logits = (m[i, t, 2 * n :] * p["scale"][2] + p["base"][2 * n :]).reshape(n, n)
      comb[i, t] = np_sinkhorn(logits, cfg.sinkhorn_iters, cfg.hc_eps)
  collapsed = sum(pre[:, :, j, None] * h[:, :, j] for j in range(n))
  return pre, post, comb, collapsed


def np_merge(post, comb, out, h):
  """new[k] = post[k] out + sum_j comb[j, k] h[j]."""
  new = np.zeros_like(h)
  for k in range(h.shape[2]):
    new[:, :, k] = post[:, :, k, None] * out + sum(comb[:, :, j, k, None] * h[:, :, j] for j in range(h.shape[2]))
  return new


def np_head(p, h, cfg):
  pre = sigmoid(np_normed_flat(h, cfg.rms_eps) @ p["hc_fn"].T * p["hc_scale"][0] + p["hc_base"]) + cfg.hc_eps
  return sum(pre[:, :, j, None] * h[:, :, j] for j in range(h.shape[2]))


def np_block(x, w):
  """The stand-in for attention or the MLP: tanh(x w)."""
  return np.tanh(x @ w)


def f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


@pytest.mark.parametrize("b,s,d,cfg", SHAPES)
def test_mixing_weights_merge_and_head_equal_numpy(b, s, d, cfg):
  rng = np.random.default_rng(cfg.hc_mult * 10 + cfg.sinkhorn_iters)
  layer, hd = random_params(rng, cfg.hc_mult, d)
  h = random_streams(rng, b, s, cfg.hc_mult, d)
  out = rng.normal(size=(b, s, d))
  want = np_mixing(layer, h, cfg)
  got = mixing(f32(layer), f32(h), cfg=cfg)
  for name, g, w in zip(("pre", "post", "comb", "collapsed"), got, want):
    assert g.dtype == jnp.float32, name
    assert_close(g, w, 1e-5)
  assert_close(merge(*got[1:3], f32(out), f32(h)), np_merge(want[1], want[2], out, h), 1e-5)
  assert_close(head(f32(hd), f32(h), cfg=cfg), np_head(hd, h, cfg), 1e-5)


def test_apply_block_equals_numpy_and_expand_repeats():
  """Two blocks from the expanded embedding, as transformers' decoder layer runs attention then the MLP."""
  cfg, (b, s, d) = hc.HyperConnectionConfig(hc_mult=4, sinkhorn_iters=20), (2, 3, 8)
  rng = np.random.default_rng(1)
  (attn_hc, _), (ffn_hc, _) = random_params(rng, 4, d), random_params(rng, 4, d)
  w_attn, w_ffn = rng.normal(size=(d, d)) / np.sqrt(d), rng.normal(size=(d, d)) / np.sqrt(d)
  x = rng.normal(size=(b, s, d))

  def layer(p_attn, p_ffn, x):
    h = hc.expand(x, cfg.hc_mult)
    h = hc.apply_block(p_attn, h, lambda y: jnp.tanh(y @ w_attn.astype(np.float32)), cfg)
    return hc.apply_block(p_ffn, h, lambda y: jnp.tanh(y @ w_ffn.astype(np.float32)), cfg)

  h = np.repeat(x[:, :, None], 4, axis=2)
  np.testing.assert_array_equal(hc.expand(f32(x), 4), np.repeat(np.float32(x)[:, :, None], 4, axis=2))
  for p, w in ((attn_hc, w_attn), (ffn_hc, w_ffn)):
    _, post, comb, collapsed = np_mixing(p, h, cfg)
    h = np_merge(post, comb, np_block(collapsed, w), h)
  assert_close(jax.jit(layer)(f32(attn_hc), f32(ffn_hc), f32(x)), h, 1e-5)


def test_comb_is_doubly_stochastic_after_many_iterations():
  """Columns (each output stream's weights) sum to 1 after any number of iterations, being normalised last (to
  sum / (sum + eps)); rows only approach 1: far off after 1 iteration, within 1e-2 after transformers' 20 at these
  logits, to float32's precision after 100. comb is not symmetric, hence merge's transpose matters."""
  rng = np.random.default_rng(2)
  layer, _ = random_params(rng, 4, 8)
  h = f32(random_streams(rng, 2, 3, 4, 8))
  for iters, row_ok in ((1, lambda e: e > 0.1), (20, lambda e: e < 1e-2), (100, lambda e: e < 1e-5)):
    comb = np.asarray(mixing(f32(layer), h, cfg=hc.HyperConnectionConfig(4, sinkhorn_iters=iters))[2], np.float64)
    assert (comb > 0).all()
    np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-4)
    rows = np.abs(comb.sum(-1) - 1).max()
    assert row_ok(rows), (iters, rows)
  assert np.abs(comb - np.swapaxes(comb, -1, -2)).max() > 1e-2


@pytest.mark.parametrize("iters", [1, 20])
def test_gradient_equals_numerical_gradient_of_numpy(iters):
  """d sum(w * block output streams) / d(streams, fn) of `apply_block` (float32) against float64 central
  differences of the NumPy block, on 4 random coordinates of each."""
  cfg, (b, s, d) = hc.HyperConnectionConfig(hc_mult=4, sinkhorn_iters=iters), (1, 2, 6)
  rng = np.random.default_rng(3 + iters)
  layer, _ = random_params(rng, 4, d)
  h = random_streams(rng, b, s, 4, d)
  w_blk, w_loss = rng.normal(size=(d, d)) / np.sqrt(d), rng.normal(size=(b, s, 4, d))

  def loss_jax(h, fn):
    block = lambda y: jnp.tanh(y @ jnp.asarray(w_blk, jnp.float32))
    return jnp.sum(hc.apply_block({**f32(layer), "fn": fn}, h, block, cfg) * w_loss)

  def loss_np(h, fn):
    _, post, comb, collapsed = np_mixing({**layer, "fn": fn}, h, cfg)
    return np.sum(np_merge(post, comb, np_block(collapsed, w_blk), h) * w_loss)

  inputs = [h, layer["fn"]]
  grads = jax.jit(jax.grad(loss_jax, argnums=(0, 1)))(*f32(inputs))
  eps = 1e-6
  for arg, (x, grad) in enumerate(zip(inputs, grads)):
    grad = np.asarray(grad, np.float64)
    for _ in range(4):
      idx = tuple(rng.integers(n) for n in x.shape)
      plus, minus = [list(inputs) for _ in range(2)]
      plus[arg], minus[arg] = x.copy(), x.copy()
      plus[arg][idx] += eps
      minus[arg][idx] -= eps
      numeric = (loss_np(*plus) - loss_np(*minus)) / (2 * eps)
      assert abs(grad[idx] - numeric) <= 1e-5 * np.abs(grad).max(), (arg, idx, grad[idx], numeric)


def test_half_precision_streams_keep_float32_weights():
  """bfloat16 streams: the weights in float32 (transformers keeps the modules in float32), the collapsed input,
  the merged streams and the head's output in bfloat16, within bfloat16's rounding of the float64 values."""
  cfg = hc.HyperConnectionConfig(hc_mult=4)
  rng = np.random.default_rng(5)
  layer, hd = random_params(rng, 4, 8)
  h = random_streams(rng, 2, 3, 4, 8)
  out = rng.normal(size=(2, 3, 8))
  h16, out16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(out, jnp.bfloat16)
  h_rounded = np.asarray(h16, np.float64)
  pre, post, comb, collapsed = mixing(f32(layer), h16, cfg=cfg)
  assert (pre.dtype, post.dtype, comb.dtype, collapsed.dtype) == (jnp.float32,) * 3 + (jnp.bfloat16,)
  want = np_mixing(layer, h_rounded, cfg)
  assert_close(comb, want[2], 1e-5)
  assert_close(collapsed, want[3], 1e-2)
  merged = merge(post, comb, out16, h16)
  assert merged.dtype == jnp.bfloat16
  assert_close(merged, np_merge(want[1], want[2], np.asarray(out16, np.float64), h_rounded), 2e-2)
  assert head(f32(hd), h16, cfg=cfg).dtype == jnp.bfloat16


def test_bad_inputs_name_the_value():
  cfg = hc.HyperConnectionConfig(hc_mult=4)
  rng = np.random.default_rng(6)
  layer, hd = f32(random_params(rng, 4, 8))
  h = jnp.ones((1, 2, 4, 8), jnp.float32) * 0.5
  with pytest.raises(ConfigError, match=r"fn\.shape=\(24, 31\).*\(24, 32\)"):
    hc.mixing_weights({**layer, "fn": layer["fn"][:, :31]}, h, cfg)
  with pytest.raises(ConfigError, match=r"hc_mult=4.*axis 2 has 3"):
    hc.mixing_weights(layer, h[:, :, :3], cfg)
  with pytest.raises(ConfigError, match=r"hc_mult=2.*axis 2 has 4"):
    hc.hyper_head(hd, h, hc.HyperConnectionConfig(hc_mult=2))
  with pytest.raises(ConfigError, match=r"missing scale"):
    hc.mixing_weights({"fn": layer["fn"], "base": layer["base"]}, h, cfg)
  with pytest.raises(ConfigError, match=r"hc_scale\.shape=\(3,\)"):
    hc.hyper_head({**hd, "hc_scale": layer["scale"]}, h, cfg)
  with pytest.raises(ConfigError, match=r"streams_BxSxNxD\.shape=\(2, 4, 8\)"):
    hc.mixing_weights(layer, h[0], cfg)
  with pytest.raises(ConfigError, match=r"comb\.shape=\(1, 2, 4, 3\)"):
    hc.merge(jnp.ones((1, 2, 4)), jnp.ones((1, 2, 4, 3)), jnp.ones((1, 2, 8)), h)
  for field, value in (("hc_mult", 0), ("sinkhorn_iters", 0), ("hc_eps", -1.0), ("rms_eps", "1e-6")):
    with pytest.raises(ConfigError, match=f"{field}={value!r}"):
      hc.HyperConnectionConfig(**{field: value})
  text = {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6}
  assert hc.HyperConnectionConfig.from_hf(text) == hc.HyperConnectionConfig(4, 20, 1e-6, 1e-6)
