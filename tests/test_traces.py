"""Routing traces against an independent recomputation: the model run block by block, each MoE
layer's choices taken in float64 NumPy from its router, and the layer's own expert counts."""

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.models import layers
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig
from moejax.models.language_model import LanguageModel
from moejax.moe.config import MoEConfig
from moejax.placement.affinity import affinity_counts
from moejax.placement.traces import routing_traces
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError

V, D, F, E = 48, 16, 32, 4


def _model(mesh, top_k):
  cfg = ModelConfig(
    kind="gpt",
    vocab_size=V,
    num_layers=2,
    d_model=D,
    num_heads=2,
    d_ff=F,
    max_len=8,
    dropout=0.0,
    moe_every=1,
    embed_init_std=0.5,
  )
  moe = MoEConfig(num_experts=E, top_k=top_k, d_model=D, d_ff=F)
  graphdef, _, _ = state_lib.abstract_state(cfg, moe, mesh, top_k)
  return nnx.merge(graphdef, *state_lib.init_state(cfg, moe, mesh, top_k))


def _numpy_choices(model, tokens, k):
  """[L, T, K] from a block-by-block forward; each MoE layer's top-k of its router logits in float64."""

  @jax.jit
  def router_inputs(tokens):
    x, inputs = model.embed_tokens(tokens), []
    for block in model.blocks:
      x = block.attend(x, train=False, rngs=None)
      inputs.append(block.ln_ffn(x))
      x, _ = block.feed_forward(x, train=False, rngs=None)
    return inputs

  choices = []
  for h, block in zip(router_inputs(tokens), model.blocks):
    logits = np.asarray(h, np.float64).reshape(-1, D) @ np.asarray(block.ffn.moe.router.kernel[...], np.float64)
    choices.append(np.argsort(-logits, axis=1, kind="stable")[:, :k])
  return np.stack(choices)


@pytest.mark.slow
def test_traces_are_the_layers_choices_and_follow_a_skewed_router():
  model = _model(mesh_lib.make_mesh(1, 2), top_k=2)
  batches = [np.random.default_rng(i).integers(0, V, (4, 8)) for i in range(2)]
  traces = routing_traces(model, batches)
  assert traces.shape == (2, 2 * 4 * 8, 2) and traces.dtype == np.int32
  both = np.concatenate(batches)  # the same tokens in the same order, one forward
  np.testing.assert_array_equal(np.sort(traces, axis=-1), np.sort(_numpy_choices(model, both, 2), axis=-1))
  # The layers' own counts of the token-choices they processed, per MoE layer.
  counts = np.asarray(jax.jit(lambda t: model(t)[1]["expert_counts"])(both))
  np.testing.assert_array_equal(counts, [np.bincount(t.reshape(-1), minlength=E) for t in traces])
  assert affinity_counts(traces, E).sum() == traces.shape[1] * 2**2

  # Skewed: LayerNorm output sums to its bias over d; with bias 1 and router column 3 raised by 50,
  # logit 3 exceeds the others by about 50 * d for every token at the second MoE layer.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  blocks = layers.per_layer(params, model.cfg)  # each layer's parameters, whether the model scans its layers or not
  blocks[1]["ln_ffn"]["bias"] = jax.numpy.ones((D,))
  router = blocks[1]["ffn"]["moe"]["router"]
  router["kernel"] = router["kernel"].at[:, 3].add(50.0)
  model = nnx.merge(graphdef, layers.with_per_layer(params, blocks, model.cfg), nnx.to_pure_dict(rest))
  skewed = routing_traces(model, batches[:1])
  assert np.all(np.any(skewed[1] == 3, axis=-1)) and len(np.unique(skewed[0])) > 2


def test_a_model_without_moe_layers_is_rejected():
  cfg = ModelConfig(kind="gpt", vocab_size=V, num_layers=1, d_model=D, num_heads=2, d_ff=F, max_len=8, moe_every=0)
  moe = MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F)
  model = nnx.eval_shape(lambda: LanguageModel(cfg, moe, mesh_lib.make_mesh(1, 2), rngs=nnx.Rngs(0)))
  with pytest.raises(ConfigError, match="moe_every"):
    routing_traces(model, [np.zeros((2, 4), np.int32)])
