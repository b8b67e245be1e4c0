"""DeepSeek-V4's sliding-window attention (`moejax.models.mixers.deepseek_v4_attention`) against float64 NumPy
written here from the formulas (each query's window as a loop over its keys, the rotation pair by pair, the grouped
projection group by group), numerical gradients of that NumPy, and its own decode path token by token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.models.mixers import deepseek_v4_attention as dsa
from moejax.validation import ConfigError

attend = jax.jit(dsa.attend, static_argnames="cfg")
decode = jax.jit(dsa.decode, static_argnames="cfg")
SHAPES = dict(hidden_size=16, num_heads=4, head_dim=8, rope_head_dim=4, q_lora_rank=12, o_groups=2, o_lora_rank=6)
B, S = 2, 12
WINDOWS = (4, 20)  # one inside the sequence, one longer than it


def config(window: int) -> dsa.DeepseekV4AttentionConfig:
  return dsa.DeepseekV4AttentionConfig(**SHAPES, sliding_window=window, rms_eps=1e-6, rope_theta=50.0)


def random_params(cfg, seed: int = 0) -> dict:
  """Every tensor random (norm weights around 1, sinks around 0), fan-in scaled."""
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in cfg.param_shapes().items():
    if name.endswith("norm.weight"):
      params[name] = 1 + 0.3 * rng.standard_normal(shape)
    elif name == "sinks":
      params[name] = rng.standard_normal(shape)
    else:
      params[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
  return params


def inputs(seed: int = 1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, S, SHAPES["hidden_size"]))
  positions = np.arange(S)[None, :] + np.array([[0], [7]])  # RoPE positions need not start at 0
  return x, positions


def f32(params: dict) -> dict:
  return {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}


def assert_close(actual, expected, rtol):
  """Every entry within rtol of the largest |expected|."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  err = np.abs(actual - expected).max() / np.abs(expected).max()
  assert err <= rtol, f"max error {err:.2e} relative to the largest entry, allowed {rtol:.0e}"


def np_rms(x, w, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 if w is None else w)


def np_rope(x, positions, rope_dim, theta, sign=1.0):
  """x [B, S, H, W]: the pair (W - R + 2i, W - R + 2i + 1) rotated by sign * position * theta^(-2i / R)."""
  out, width = x.copy(), x.shape[-1]
  for i in range(rope_dim // 2):
    angle = sign * positions[..., None] * theta ** (-2.0 * i / rope_dim)
    a, b = width - rope_dim + 2 * i, width - rope_dim + 2 * i + 1
    out[..., a] = x[..., a] * np.cos(angle) - x[..., b] * np.sin(angle)
    out[..., b] = x[..., b] * np.cos(angle) + x[..., a] * np.sin(angle)
  return out


def np_layer(p, x, positions, cfg):
  """The layer in float64, every query of every head over its window's keys one at a time."""
  b, s, _ = x.shape
  h, w, g, ro, eps = cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.rms_eps
  q = np_rms(x @ p["q_a_proj.weight"].T, p["q_a_norm.weight"], eps) @ p["q_b_proj.weight"].T
  q = np_rope(np_rms(q.reshape(b, s, h, w), None, eps), positions, cfg.rope_head_dim, cfg.rope_theta)  # per head
  kv = np_rms(x @ p["kv_proj.weight"].T, p["kv_norm.weight"], eps)[:, :, None]
  kv = np_rope(kv, positions, cfg.rope_head_dim, cfg.rope_theta)[:, :, 0]
  o = np.zeros((b, s, h, w))
  for i in range(b):
    for t in range(s):
      keys = range(max(0, t - cfg.sliding_window + 1), t + 1)
      for j in range(h):
        logits = np.array([q[i, t, j] @ kv[i, u] / np.sqrt(w) for u in keys])
        weights = np.exp(logits) / (np.exp(logits).sum() + np.exp(p["sinks"][j]))
        o[i, t, j] = sum(wt * kv[i, u] for wt, u in zip(weights, keys))
  o = np_rope(o, positions, cfg.rope_head_dim, cfg.rope_theta, sign=-1.0).reshape(b, s, h * w)
  per_group = h * w // g
  grouped = [
    o[..., k * per_group : (k + 1) * per_group] @ p["o_a_proj.weight"][k * ro : (k + 1) * ro].T for k in range(g)
  ]
  return np.concatenate(grouped, axis=-1) @ p["o_b_proj.weight"].T


@pytest.mark.parametrize("window", WINDOWS)
def test_forward_matches_numpy(window):
  cfg = config(window)
  params, (x, positions) = random_params(cfg), inputs()
  y = attend(f32(params), jnp.asarray(x, jnp.float32), jnp.asarray(positions), cfg)
  assert_close(y, np_layer(params, x, positions, cfg), 1e-5)


def test_gradients_match_numerical():
  cfg = config(WINDOWS[0])
  params, (x, positions) = random_params(cfg), inputs()
  weights = np.random.default_rng(2).standard_normal((B, S, SHAPES["hidden_size"]))  # loss = sum(weights * y)

  def loss(x32, p32):
    return jnp.sum(jnp.asarray(weights, jnp.float32) * dsa.attend(p32, x32, jnp.asarray(positions), cfg))

  grad_x, grad_p = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x, jnp.float32), f32(params))
  grads = {"x": grad_x, "kv_proj.weight": grad_p["kv_proj.weight"], "sinks": grad_p["sinks"]}
  check_central_differences(grads, lambda ps, xs: np_layer(ps, xs, positions, cfg), params, x, weights, per=3)


def check_central_differences(grads: dict, layer, params: dict, x, weights, per: int) -> None:
  """Each of `grads` ({'x' or a tensor's name: jax's gradient of sum(weights * y)}) at `per` random entries against
  float64 central differences of layer(params, x) (the NumPy reference), within 1e-4 of its largest entry."""
  rng, eps = np.random.default_rng(3), 1e-6
  for name, analytic in grads.items():
    analytic = np.asarray(analytic, np.float64)
    for flat in rng.choice(analytic.size, per, replace=False):
      index = np.unravel_index(flat, analytic.shape)
      numeric = []
      for step in (eps, -eps):
        xs, ps = x.copy(), {k: v.copy() for k, v in params.items()}
        (xs if name == "x" else ps[name])[index] += step
        numeric.append(np.sum(weights * layer(ps, xs)))
      numeric = (numeric[0] - numeric[1]) / (2 * eps)
      assert abs(analytic[index] - numeric) <= 1e-4 * np.abs(analytic).max(), (name, index, analytic[index], numeric)


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_matches_forward(window):
  """A 5-token prompt in one call, then one token per call, equals the whole sequence at once."""
  cfg = config(window)
  params, (x, positions) = f32(random_params(cfg)), inputs()
  x, positions = jnp.asarray(x, jnp.float32), jnp.asarray(positions)
  full = attend(params, x, positions, cfg)
  cache = dsa.empty_cache(cfg, B)
  y, cache = decode(params, x[:, :5], cache, positions[:, :5], cfg)
  pieces = [y]
  for t in range(5, S):
    y, cache = decode(params, x[:, t : t + 1], cache, positions[:, t : t + 1], cfg)
    pieces.append(y)
  assert cache["kv"].shape == (B, window, SHAPES["head_dim"]) and int(cache["length"]) == S
  assert_close(jnp.concatenate(pieces, axis=1), full, 1e-5)


def test_bad_shapes_and_groups_are_named():
  cfg = config(4)
  params = f32(random_params(cfg))
  params["o_a_proj.weight"] = params["o_a_proj.weight"].T
  with pytest.raises(ConfigError, match=r"o_a_proj\.weight.*\(16, 12\).*\(12, 16\)"):
    dsa.attend(params, jnp.ones((1, 3, 16)), jnp.arange(3)[None], cfg)
  with pytest.raises(ConfigError, match="o_groups=3.*divisor of num_heads=4"):
    dsa.DeepseekV4AttentionConfig(**{**SHAPES, "o_groups": 3}, sliding_window=4)
  with pytest.raises(ConfigError, match="rope_head_dim=5"):
    dsa.DeepseekV4AttentionConfig(**{**SHAPES, "rope_head_dim": 5}, sliding_window=4)


def test_from_hf_reads_the_sliding_fields():
  """A config.json's fields (the hub's legacy qk_rope_head_dim, the nested 'main' rope) -> the layer's config."""
  hf = {**{k: v for k, v in SHAPES.items() if k not in ("num_heads", "rope_head_dim")}, "num_attention_heads": 4}
  hf.update(qk_rope_head_dim=4, sliding_window=4, rms_norm_eps=1e-6)
  hf["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 50.0}, "compress": {"rope_type": "yarn"}}
  assert dsa.DeepseekV4AttentionConfig.from_hf(hf) == config(4)
  with pytest.raises(ConfigError, match="rope_parameters.main.rope_type='yarn'"):
    dsa.DeepseekV4AttentionConfig.from_hf({**hf, "rope_parameters": {"main": {"rope_type": "yarn"}}})


def test_a_layer_from_scratch_starts_as_transformers_initialises_it():
  """The tiny preset's layers (configs/decoder.py), bf16 parameters: every norm weight (nested ones included:
  `q_a_norm.weight`, a compressor's `kv_norm.weight`) starts at 1, sinks and position biases at 0, in float32 like
  mHC's tensors; the projections are random in the parameters' dtype."""
  from flax import nnx

  from configs import decoder
  from moejax.models import deepseek_v4_mixer
  from moejax.train import config as config_lib

  config = decoder.get_config("deepseek_v4")
  config.model.param_dtype = "bfloat16"
  model_cfg = config_lib.validate(config)[0]
  seen = set()
  for layer in range(model_cfg.num_layers):
    tensors = deepseek_v4_mixer.DeepseekV4Attention(model_cfg, layer, rngs=nnx.Rngs(0)).tensors()
    seen |= set(tensors)
    for name, value in tensors.items():
      values = np.asarray(value.astype(jnp.float32))
      if name.endswith("norm.weight"):
        assert value.dtype == jnp.float32 and np.all(values == 1), name
      elif name.endswith(("sinks", "position_bias")):
        assert value.dtype == jnp.float32 and np.all(values == 0), name
      else:
        assert value.dtype == jnp.bfloat16 and 0.005 < values.std() < 0.05, name
  assert {"q_a_norm.weight", "compressor.kv_norm.weight", "compressor.indexer.position_bias"} <= seen
