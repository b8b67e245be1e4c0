"""The memory planner's count of the 2026 families' token mixers and blocks (`moejax.study.memory_blocks`): what JAX's
autodiff keeps for a mixer other than attention or for an mHC wrap (traced, `residual_bytes`) against what XLA keeps,
read as the layer scaling of docs/memory.md reads it: the compiled temp of the forward and backward of two such
layers in a chain minus that of one, on one device; and the per-layer wiring of the analytic count."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import decoder
from moejax.models import hyper_block, sparse_attention, token_mixers
from moejax.models.config import from_sections
from moejax.study import memory as memory_lib
from moejax.study import memory_blocks

ROWS, SEQ = 2, 128
# The traced residuals with the layer's input against what XLA keeps, measured here (2 x 128 tokens, 2026-11-30):
# gated DeltaNet +15%, KDA +29%, DSA +36% (shared +45%), DeepSeek-V4's attention +48-50% (XLA recomputes inside the
# backward's fusions what the trace counts: one of three S x S float32 arrays, the mask), an mHC wrap -8% (XLA keeps
# a second copy of the streams).
LOW, HIGH = 0.9, 1.6


def _config(family: str, **model):
  config = decoder.get_config(family)
  config.model.update(model)
  return from_sections(config)[0]


CASES = {  # name: (family, model fields, layer, its mixer)
  "gated_deltanet": ("qwen3_next", {}, 0, "gated_deltanet"),
  "kimi_delta": ("kimi_linear", {}, 0, "kimi_delta"),
  "dsa": ("deepseek_v32", {}, 0, "dsa"),
  "dsa_shared": ("glm_moe_dsa", {"mixers": ("dsa", "dsa_shared", "dsa")}, 1, "dsa_shared"),
  "deepseek_v4_sliding": ("deepseek_v4", {}, 0, "deepseek_v4"),  # the tiny config's layer types
  "deepseek_v4_csa": ("deepseek_v4", {}, 1, "deepseek_v4"),
  "deepseek_v4_hca": ("deepseek_v4", {}, 2, "deepseek_v4"),
}
NO_EXCHANGE = {"buffer_rows": 0, "hop_rows": [0]}  # the MoE layers' rows are not what is compared here


def _compiled_slope(loss, specs_of) -> int:
  """The compiled temp of jax.grad(loss) over a chain of two layers minus one (`specs_of(n)`: its arguments)."""
  temp = lambda n: (
    jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*specs_of(n)).compile().memory_analysis().temp_size_in_bytes
  )
  return temp(2) - temp(1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.sampled(2)
def test_traced_mixer_bytes_bound_what_xla_keeps(case):
  family, fields, layer, name = CASES[case]
  cfg = _config(family, **fields)
  mixer = token_mixers.of(cfg, layer)
  assert mixer.name == name
  traced = memory_blocks.traced_mixer_bytes(cfg, ROWS, SEQ)
  assert [t is None for t in traced] == [token_mixers.of(cfg, i).name == "attention" for i in range(cfg.num_layers)]

  def loss(state, x):
    for module in nnx.merge(graphdef, state):
      x = x + sparse_attention.activations(module(sparse_attention.begin(cfg, x)))
    return jnp.sum(x.astype(jnp.float32))

  def specs_of(n):
    nonlocal graphdef
    graphdef, state = nnx.split(nnx.eval_shape(lambda: nnx.List([mixer.build(cfg, layer, rngs=nnx.Rngs(0))] * n)))
    return state, jax.ShapeDtypeStruct((ROWS, SEQ, cfg.d_model), np.dtype(cfg.dtype))

  graphdef = None
  slope = _compiled_slope(loss, specs_of)
  kept = traced[layer] + ROWS * SEQ * cfg.d_model * np.dtype(cfg.dtype).itemsize  # and the layer's input
  assert LOW * slope <= kept <= HIGH * slope, (kept, slope)


def test_mhc_bytes_bound_what_xla_keeps():
  cfg = _config("deepseek_v4")
  config = hyper_block.hyper_config(cfg)
  n, d = config.hc_mult, cfg.d_model

  def loss(params, streams):
    for p in params:
      _, post, comb, collapsed = hyper_block.hc.mixing_weights(p, streams, config)
      streams = hyper_block.hc.merge(post, comb, jnp.tanh(collapsed), streams)
    return jnp.sum(streams.astype(jnp.float32))

  spec = lambda *shape, dtype=np.float32: jax.ShapeDtypeStruct(shape, dtype)
  one = {"fn": spec(config.num_weights, n * d), "base": spec(config.num_weights), "scale": spec(3)}
  slope = _compiled_slope(loss, lambda k: ([one] * k, spec(ROWS, SEQ, n, d, dtype=np.dtype(cfg.dtype))))
  # beside the wrap, a layer of the chain keeps its streams in (N T d, `layer_blocks` counts them) and its tanh's output
  kept = memory_blocks.mhc_bytes(cfg, ROWS, SEQ) + (n + 1) * ROWS * SEQ * d * np.dtype(cfg.dtype).itemsize
  assert LOW * slope <= kept <= HIGH * slope, (kept, slope)


def test_each_layer_counts_its_own_mixer():
  """Turning one attention layer of Qwen3-Next into a gated DeltaNet layer changes the analytic activations by
  exactly the traced mixer's bytes less attention's (its q, k, v, output and softmax), without remat."""
  cfg = _config("qwen3_next", remat="none")
  assert cfg.mixers[1] == "attention"
  changed = dataclasses.replace(cfg, mixers=cfg.mixers[:1] + ("gated_deltanet",) + cfg.mixers[2:])
  counts = [memory_lib.analytic_activations(c, _moe(c), ROWS, SEQ, NO_EXCHANGE)["activations"] for c in (cfg, changed)]
  _, parts = memory_blocks.layer_blocks(cfg, _moe(cfg), ROWS, SEQ, NO_EXCHANGE)
  b = np.dtype(cfg.dtype).itemsize
  attention = parts["attention"] - 4 * ROWS * SEQ * cfg.d_model * b + parts["scores"]
  deltanet = memory_blocks.traced_mixer_bytes(cfg, ROWS, SEQ)[0]
  assert deltanet > 0 and attention > 0
  assert counts[1] - counts[0] == pytest.approx(deltanet - attention, abs=1)


def _moe(cfg):
  config = decoder.get_config(cfg.family)
  return from_sections(config)[1]


def test_hyper_connected_blocks_count_their_wraps_and_streams():
  """Each DeepSeek-V4 layer: its norms, its own mixer, its FFN and two mHC wraps each with its N streams in; remat
  keeps its N streams."""
  cfg = _config("deepseek_v4", remat="none")
  blocks, parts = memory_blocks.layer_blocks(cfg, _moe(cfg), ROWS, SEQ, NO_EXCHANGE)
  traced = memory_blocks.traced_mixer_bytes(cfg, ROWS, SEQ)
  n, tdb = hyper_block.hyper_config(cfg).hc_mult, ROWS * SEQ * cfg.d_model * np.dtype(cfg.dtype).itemsize
  wraps = 2 * (memory_blocks.mhc_bytes(cfg, ROWS, SEQ) + n * tdb)
  for i, block in enumerate(blocks[: cfg.num_layers]):
    ffn = parts["moe_ffn"] if cfg.is_moe(i) else parts["dense_ffn"]
    assert block["none"] == 4 * tdb + traced[i] + ffn + wraps
    assert block["input"] == n * tdb
