"""The QK-norm modes (`moejax.models.qk_norm`): one registry owns their names (DecoderConfig's allowed values), their
weights' shapes and counts (the memory planner's, the decoder step's FLOPs') and where each acts; no module outside it
compares a qk_norm_mode; HunYuan's norm after RoPE against NumPy, with and without the KV cache (its keys cached
normed)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.models import attention, qk_norm
from moejax.models.decoder_config import DecoderConfig
from moejax.study import memory
from moejax.validation import ConfigError
from tests.helpers import ROOT, normal, relative_error
from tests.test_attention import TOL, B, S, config, np_linear, np_rms, np_rope, numpy_attention, randomized


def test_decoder_config_allows_the_registrys_names_only():
  assert DecoderConfig.__dataclass_fields__["qk_norm_mode"].default in qk_norm.MODES
  for name in qk_norm.NAMES:
    assert config(False, qk_norm_mode=name).qk_norm_mode == name
  with pytest.raises(ConfigError, match="qk_norm_mode") as error:
    config(False, qk_norm_mode="after_rope")
  assert all(name in str(error.value) for name in qk_norm.NAMES)


@pytest.mark.parametrize(
  "name, where, shapes",
  [
    ("head", "before_rope", [16, 16]),
    ("projection", "projection", [64, 32]),
    ("head_after_rope", "after_rope", [16, 16]),
  ],
)
def test_each_mode_says_its_weights_and_where_it_acts(name, where, shapes):
  """4 query heads and 2 key/value heads 16 wide: the modules built, the planner's leaves and the count agree."""
  cfg, mode = config(False, qk_norm_mode=name), qk_norm.MODES[name]
  assert qk_norm.of(cfg) is mode and mode.where == where
  assert [s[0] for s in mode.shapes(cfg)] == shapes and mode.count(cfg) == sum(shapes)
  module = attention.attention(cfg, 0, rngs=nnx.Rngs(0))
  assert [module.q_norm.weight.shape[0], module.k_norm.weight.shape[0]] == shapes
  size = lambda cfg: sum(int(np.prod(leaf.shape)) * leaf.count for leaf in memory.decoder_leaves(cfg)[1])
  assert size(cfg) - size(config(False, qk_norm=False)) == mode.count(cfg)  # the memory planner's count


def test_no_module_outside_the_registry_compares_a_mode_name():
  pattern = re.compile(r"qk_norm_mode\s*[!=]=|[!=]=\s*\S*qk_norm_mode")
  offenders = [
    str(path.relative_to(ROOT))
    for path in sorted((ROOT / "moejax").rglob("*.py"))
    if path.name != "qk_norm.py" and pattern.search(path.read_text())
  ]
  assert not offenders, offenders


def np_gqa_after_rope(cfg, p, x_BxSxD):
  """HunYuan's attention in float64: RoPE, then each head's RMSNorm, then the softmax."""
  (b, s, _), h, kv, w = x_BxSxD.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  positions = np.arange(s, dtype=np.float64)
  q = np_linear(p["q_proj"], x_BxSxD).reshape(b, s, h, w)
  k, v = np_linear(p["k_proj"], x_BxSxD).reshape(b, s, kv, w), np_linear(p["v_proj"], x_BxSxD).reshape(b, s, kv, w)
  q, k = np_rope(q, positions, cfg.rope_theta), np_rope(k, positions, cfg.rope_theta)
  q, k = np_rms(q, p["q_norm"]["weight"], cfg.rms_eps), np_rms(k, p["k_norm"]["weight"], cfg.rms_eps)
  out = numpy_attention(q, k, v, w**-0.5, np.arange(s), cfg.sliding_window)
  return np_linear(p["o_proj"], out.reshape(b, s, h * w))


def test_norm_after_rope_matches_numpy_with_and_without_cache():
  """The whole sequence, then a prefill of 7 tokens and 5 single steps over a 16-slot cache of garbage: the cached
  keys are the normed rotated ones, so every step attends as the whole sequence does."""
  cfg = config(False, qk_norm_mode="head_after_rope", attention_impl="xla")
  module = attention.attention(cfg, 0, rngs=nnx.Rngs(0))
  params = randomized(module)
  x = normal(50, (B, S, cfg.d_model))
  want = np_gqa_after_rope(cfg, params, x.astype(np.float64))
  assert relative_error(nnx.jit(lambda m, x: m(x))(module, jnp.asarray(x)), want) < TOL["float32"]
  cache = tuple(1e3 * normal(60 + i, shape) for i, shape in enumerate(attention.cache_shapes(cfg, B, 16)))
  step = nnx.jit(lambda m, x, c1, c2, start: m(x, cache=(c1, c2, start)))
  outs = []
  for start, count in ((0, 7), (7, 1), (8, 1), (9, 1), (10, 1), (11, 1)):
    out, cache = step(module, jnp.asarray(x[:, start : start + count]), *cache, jnp.int32(start))
    outs.append(out)
  assert relative_error(jnp.concatenate(outs, axis=1), want) < TOL["float32"]
  keys = np.asarray(cache[0][:, :S], np.float64) / params["k_norm"]["weight"]
  np.testing.assert_allclose(np.sqrt(np.mean(keys**2, axis=-1)), 1.0, rtol=1e-3)  # cached after the norm
