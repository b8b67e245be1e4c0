"""Attention through a kept library (`moejax.models.attention.attend`: `jax.nn.dot_product_attention`, XLA or cuDNN,
or tokamax's) against an independent float64 NumPy attention on fresh random inputs: grouped-query heads, MLA's
unequal q/k and v widths, causal and sliding-window masks, sinks, the KV cache (prefill, steps and a chunk, slots not
written yet holding garbage), gradients; the families' modules (QK-norm, biases, MLA) whole against NumPy, with and
without the cache; 'auto' and the refusals of what cannot run, each naming attention_impl.

Every implementation that runs here is tested: 'xla' everywhere, 'cudnn' (bfloat16 only) on a GPU that takes it,
'tokamax' where it is installed.
"""

import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.models import attention
from moejax.models.decoder_config import DecoderConfig
from moejax.validation import ConfigError
from tests.helpers import normal, relative_error

B, S = 2, 12
TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # bf16: inputs and probabilities rounded to 8 bits of mantissa
DEVICE = jax.devices()[0]
IMPLS = (
  ["xla"]
  + (["cudnn"] if attention.cudnn_refusal("bfloat16", 16, False, DEVICE) is None else [])
  + (["tokamax"] if importlib.util.find_spec("tokamax") else [])
)
RUNS = [(impl, dtype) for impl in IMPLS for dtype in TOL if not (impl == "cudnn" and dtype == "float32")]

# name: (query heads, key/value heads, q/k width, v width, window, sinks)
CASES = {
  "mha": (4, 4, 16, 16, None, False),
  "gqa": (4, 2, 16, 16, None, False),
  "mla_widths": (4, 4, 24, 16, None, False),
  "sliding_window": (4, 2, 16, 16, 4, False),
  "sinks": (4, 2, 16, 16, None, True),
  "sinks_sliding_window": (4, 2, 16, 16, 4, True),
}


def numpy_attention(q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, scale, query_positions_S, window=None, sinks_H=None):
  """float64 softmax attention: the key in slot t visible to the query at p iff t <= p and p - t < window; a sink
  adds exp(sink) to each head's denominator."""
  q, k, v = (np.asarray(a, np.float64) for a in (q_BxSxHxW, k_BxSxHxW, v_BxSxHxW))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("bqhw,bkhw->bhqk", q, k) * scale
  behind = np.asarray(query_positions_S)[:, None] - np.arange(k.shape[1])[None, :]
  visible = (behind >= 0) & (behind < (window or np.inf))
  logits = np.where(visible, logits, -np.inf)
  if sinks_H is not None:
    sink = np.broadcast_to(np.asarray(sinks_H, np.float64)[None, :, None, None], (*logits.shape[:3], 1))
    logits = np.concatenate([logits, sink], axis=-1)
  weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
  probs = (weights / weights.sum(axis=-1, keepdims=True))[..., : k.shape[1]]
  return np.einsum("bhqk,bkhw->bqhw", probs, v)


def draw(case: str, seed: int, keys: int = S):
  """Fresh q [B, S, H, W], k [B, keys, H_kv, W], v [B, keys, H_kv, W_v], sinks [H] (or None) of a case."""
  h, kv, w, wv, _, sinks = CASES[case]
  q, k, v = normal(seed, (B, S, h, w)), normal(seed + 1, (B, keys, kv, w)), normal(seed + 2, (B, keys, kv, wv))
  return q, k, v, (2 * normal(seed + 3, (h,)) if sinks else None)


def rounded(a, dtype: str):
  return None if a is None else np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))


@pytest.mark.parametrize("impl, dtype", RUNS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.sampled(1)
def test_attention_matches_numpy(case, impl, dtype):
  q, k, v, sinks = draw(case, seed=10)
  window, scale = CASES[case][4], CASES[case][2] ** -0.5
  fn = jax.jit(lambda q, k, v, s: attention.attend(q, k, v, impl, scale, window, sinks_H=s))
  got = fn(*(jnp.asarray(a, dtype) for a in (q, k, v)), sinks)
  assert got.shape == (B, S, CASES[case][0], CASES[case][3]) and got.dtype == jnp.dtype(dtype)
  q, k, v = (rounded(a, dtype) for a in (q, k, v))
  assert relative_error(got, numpy_attention(q, k, v, scale, np.arange(S), window, sinks)) < TOL[dtype]


# bf16 over the cache in the slow runs only: the masks are the fp32 runs', the rounding test_attention_matches_numpy's.
@pytest.mark.parametrize(
  "impl, dtype", [pytest.param(*run, marks=[pytest.mark.slow] if run[1] == "bfloat16" else []) for run in RUNS]
)
@pytest.mark.parametrize("case", ["gqa", "mla_widths", "sinks_sliding_window"])
def test_attention_over_a_cache_matches_numpy(case, impl, dtype):
  """Queries at start .. start + S' - 1 (prefill, one step, a chunk) over a 20-slot cache whose slots from start + S'
  on hold garbage a thousand times larger than the keys: hidden, as the slots before each query are not."""
  length = 20
  q, k, v, sinks = draw(case, seed=20, keys=length)
  garbage = 1e3 * normal(24, k.shape)
  window, scale = CASES[case][4], CASES[case][2] ** -0.5
  fn = jax.jit(lambda q, k, v, positions, s: attention.attend(q, k, v, impl, scale, window, positions, s))
  for start, count in ((0, 7), (7, 1), (8, 3), (19, 1)):
    written = np.arange(length) < start + count
    k_now = np.where(written[None, :, None, None], k, garbage)
    v_now = np.where(written[None, :, None, None], v, garbage[..., : v.shape[-1]])
    positions = start + np.arange(count)
    cast = lambda a: jnp.asarray(a, dtype)
    got = fn(cast(q[:, :count]), cast(k_now), cast(v_now), jnp.asarray(positions), sinks)
    want = numpy_attention(
      rounded(q[:, :count], dtype), rounded(k_now, dtype), rounded(v_now, dtype), scale, positions, window, sinks
    )
    assert relative_error(got, want) < TOL[dtype], (start, count)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "cudnn"])  # fp32: the directional derivative's precision
@pytest.mark.parametrize("case", ["gqa", "mla_widths", "sinks_sliding_window"])
def test_gradients_match_numpy(case, impl):
  """The gradient of <attention, c> with respect to q, k, v (and the sinks) along a random direction, against the
  central difference of the float64 NumPy attention."""
  q, k, v, sinks = draw(case, seed=30)
  window, scale = CASES[case][4], CASES[case][2] ** -0.5
  c = normal(34, (B, S, CASES[case][0], CASES[case][3]))
  inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
  directions = [normal(40 + i, a.shape) for i, a in enumerate(inputs)]

  def loss(*args):
    return jnp.sum(attention.attend(*args[:3], impl, scale, window, sinks_H=args[3] if len(args) > 3 else None) * c)

  grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))(*inputs)
  got = sum(np.vdot(np.asarray(g, np.float64), u) for g, u in zip(grads, directions))
  eps = 1e-4

  def numpy_loss(sign):
    moved = [a.astype(np.float64) + sign * eps * u for a, u in zip(inputs, directions)]
    sinks_moved = moved[3] if len(moved) > 3 else None
    return np.sum(numpy_attention(*moved[:3], scale, np.arange(S), window, sinks_moved) * c)

  want = (numpy_loss(1) - numpy_loss(-1)) / (2 * eps)
  assert abs(got - want) < 1e-4 * abs(want), (got, want)


# ---------------------------------------------------------------------------------------------------------------
# The families' modules, whole: projections, QK-norm, RoPE, attention, output projection


def config(latent: bool, **fields) -> DecoderConfig:
  shape = (
    dict(
      family="deepseek_v3",
      q_lora_rank=16,
      kv_lora_rank=16,
      qk_nope_head_dim=16,
      qk_rope_head_dim=8,
      v_head_dim=16,
      rope_interleaved=False,
    )
    if latent
    else dict(family="qwen3", qk_norm=True, qkv_bias=True, out_bias=True, sliding_window=5)
  )
  return DecoderConfig(
    **{
      **dict(
        vocab_size=32,
        num_layers=1,
        d_model=32,
        d_ff=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_len=64,
        moe_layers=(False,),
      ),
      **shape,
      **fields,
    }
  )


def randomized(module) -> dict:
  """Gives the module fresh parameters of unit-scale outputs (kernels normal / sqrt(fan-in), biases small, norm
  weights near 1: the initial 0.02-wide kernels would make every softmax nearly uniform); returns them in float64."""
  state = nnx.state(module, nnx.Param)
  leaves, tree = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
  drawn = []
  for i, (path, leaf) in enumerate(leaves):
    name, draw_i = jax.tree_util.keystr(path), normal(100 + i, leaf.shape)
    drawn.append(
      draw_i / np.sqrt(leaf.shape[0])
      if name.endswith("['kernel']")
      else 0.1 * draw_i
      if name.endswith("['bias']")
      else 1 + 0.2 * draw_i
    )
  nnx.replace_by_pure_dict(state, jax.tree.unflatten(tree, drawn))
  nnx.update(module, state)
  return jax.tree.unflatten(tree, [a.astype(np.float64) for a in drawn])


def np_rms(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def np_rope(x_BxSxHxW, positions_S, theta):
  """Half-split RoPE: dimension i paired with i + W / 2, angle position x theta^(-2i / W)."""
  half = x_BxSxHxW.shape[-1] // 2
  angles = positions_S[:, None] * theta ** (-np.arange(half) * 2.0 / (2 * half))[None, :]
  cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
  first, second = x_BxSxHxW[..., :half], x_BxSxHxW[..., half:]
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def np_linear(p, x):
  return x @ p["kernel"] + p.get("bias", 0)


def np_gqa(cfg, p, x_BxSxD):
  (b, s, _), h, kv, w = x_BxSxD.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  positions = np.arange(s, dtype=np.float64)
  q = np_linear(p["q_proj"], x_BxSxD).reshape(b, s, h, w)
  k, v = np_linear(p["k_proj"], x_BxSxD).reshape(b, s, kv, w), np_linear(p["v_proj"], x_BxSxD).reshape(b, s, kv, w)
  q, k = np_rms(q, p["q_norm"]["weight"], cfg.rms_eps), np_rms(k, p["k_norm"]["weight"], cfg.rms_eps)
  q, k = np_rope(q, positions, cfg.rope_theta), np_rope(k, positions, cfg.rope_theta)
  out = numpy_attention(q, k, v, w**-0.5, np.arange(s), cfg.sliding_window)
  return np_linear(p["o_proj"], out.reshape(b, s, h * w))


def np_mla(cfg, p, x_BxSxD):
  (b, s, _), h, nope, r, c = x_BxSxD.shape, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
  positions = np.arange(s, dtype=np.float64)
  q_latent = np_rms(np_linear(p["q_a_proj"], x_BxSxD), p["q_a_layernorm"]["weight"], cfg.rms_eps)
  q = np_linear(p["q_b_proj"], q_latent).reshape(b, s, h, nope + r)
  compressed = np_linear(p["kv_a_proj_with_mqa"], x_BxSxD)
  latent = np_rms(compressed[..., :c], p["kv_a_layernorm"]["weight"], cfg.rms_eps)
  rotary_key = np_rope(compressed[..., None, c:], positions, cfg.rope_theta)  # one head, shared
  kv = np_linear(p["kv_b_proj"], latent).reshape(b, s, h, nope + cfg.v_head_dim)
  k = np.concatenate([kv[..., :nope], np.broadcast_to(rotary_key, (b, s, h, r))], axis=-1)
  q = np.concatenate([q[..., :nope], np_rope(q[..., nope:], positions, cfg.rope_theta)], axis=-1)
  out = numpy_attention(q, k, kv[..., nope:], (nope + r) ** -0.5, np.arange(s))
  return np_linear(p["o_proj"], out.reshape(b, s, h * cfg.v_head_dim))


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "cudnn"])  # fp32 modules
@pytest.mark.parametrize("latent", [False, True], ids=["gqa_qk_norm_window", "mla"])
def test_module_matches_numpy_with_and_without_cache(latent, impl):
  """The family's module (GQA: QK-norm, q/k/v and output biases, a 5-token window; MLA: low-rank q, latent keys and
  values, a shared rotary key) on a whole sequence, then as prefill (7 tokens) and 5 single steps over a 16-slot
  cache that starts as garbage, against the NumPy module on the whole sequence."""
  cfg = config(latent, attention_impl=impl)
  module = attention.attention(cfg, 0, rngs=nnx.Rngs(0))
  params = randomized(module)
  x = normal(50, (B, S, cfg.d_model))
  want = (np_mla if latent else np_gqa)(cfg, params, x.astype(np.float64))
  assert relative_error(nnx.jit(lambda m, x: m(x))(module, jnp.asarray(x)), want) < TOL["float32"]

  cache = tuple(1e3 * normal(60 + i, shape) for i, shape in enumerate(attention.cache_shapes(cfg, B, 16)))
  step = nnx.jit(lambda m, x, c1, c2, start: m(x, cache=(c1, c2, start)))
  outs = []
  for start, count in ((0, 7), (7, 1), (8, 1), (9, 1), (10, 1), (11, 1)):
    out, cache = step(module, jnp.asarray(x[:, start : start + count]), *cache, jnp.int32(start))
    outs.append(out)
  assert relative_error(jnp.concatenate(outs, axis=1), want) < TOL["float32"]


# ---------------------------------------------------------------------------------------------------------------
# Which implementation runs, and what is refused


def gpu(capability: str = "9.0"):
  return types.SimpleNamespace(platform="gpu", compute_capability=capability, device_kind="NVIDIA test GPU")


@pytest.mark.parametrize(
  "dtype, width, sinks, device, why",
  [
    ("bfloat16", 128, False, gpu(), None),  # Qwen3-MoE's heads
    ("bfloat16", 192, False, gpu(), None),  # DeepSeek-V3's q/k (v 128, padded to 192)
    ("bfloat16", 192, False, gpu("8.0"), "at most 128 wide"),  # before Hopper
    ("bfloat16", 264, False, gpu(), "at most 256 wide"),
    ("bfloat16", 100, False, gpu(), "multiple of 8"),
    ("float32", 128, False, gpu(), "16-bit"),
    ("bfloat16", 128, True, gpu(), "sinks"),
    ("bfloat16", 128, False, types.SimpleNamespace(platform="cpu", device_kind="cpu"), "cpu device"),
    ("bfloat16", 128, False, types.SimpleNamespace(platform="gpu", device_kind="AMD GPU"), "CUDA"),
  ],
)
def test_auto_takes_cudnn_where_it_runs_and_cudnn_is_refused_elsewhere(monkeypatch, dtype, width, sinks, device, why):
  monkeypatch.setattr(attention, "cudnn_probe", lambda device, width: None)  # the trial run passes on these GPUs
  assert attention.resolve_impl("auto", dtype, width, sinks, device) == ("cudnn" if why is None else "xla")
  assert attention.resolve_impl("xla", dtype, width, sinks, device) == "xla"
  if why is None:
    assert attention.resolve_impl("cudnn", dtype, width, sinks, device) == "cudnn"
    return
  with pytest.raises(ConfigError, match=why) as e:
    attention.resolve_impl("cudnn", dtype, width, sinks, device)
  assert e.value.field == "attention_impl" and str(e.value).startswith("config field attention_impl='cudnn'")


def test_a_failed_cudnn_trial_run_makes_auto_take_xla_and_refuses_cudnn(monkeypatch):
  monkeypatch.setattr(attention, "cudnn_probe", lambda device, width: "cuDNN's attention failed a trial run (X)")
  assert attention.resolve_impl("auto", "bfloat16", 128, device=gpu()) == "xla"
  with pytest.raises(ConfigError, match="failed a trial run") as e:
    attention.resolve_impl("cudnn", "bfloat16", 128, device=gpu())
  assert e.value.field == "attention_impl"


def test_the_cudnn_trial_run_reports_its_failure_while_a_model_is_traced():
  """The trial run is concrete inside a trace (the models are built under nnx.eval_shape); here, with no cuDNN, it
  fails, and says so instead of raising."""
  if DEVICE.platform == "gpu":
    pytest.skip("cuDNN may run here")
  attention.cudnn_probe.cache_clear()
  reasons = []
  jax.eval_shape(lambda x: reasons.append(attention.cudnn_probe(DEVICE, 16)) or x, 0.0)
  assert reasons[0].startswith("cuDNN's attention failed a trial run on this device (")


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_the_model_takes_xla_here_and_refuses_what_cannot_run_before_tracing(latent):
  if DEVICE.platform == "gpu":
    pytest.skip("the CPU's choices")
  assert attention.attention(config(latent), 0, rngs=nnx.Rngs(0)).impl == "xla"  # 'auto'
  with pytest.raises(ConfigError, match="cpu device") as e:
    attention.attention(config(latent, attention_impl="cudnn"), 0, rngs=nnx.Rngs(0))
  assert e.value.field == "attention_impl"
  if importlib.util.find_spec("tokamax") is None:
    with pytest.raises(ConfigError, match="tokamax installed") as e:
      attention.attention(config(latent, attention_impl="tokamax"), 0, rngs=nnx.Rngs(0))
    assert e.value.field == "attention_impl"
  with pytest.raises(ConfigError, match="one of") as e:
    config(latent, attention_impl="flash")
  assert e.value.field == "attention_impl"
