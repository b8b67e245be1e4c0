"""The token mixers of a decoder layer, one object each (`MIXERS`, by `DecoderConfig.mixers`' names): what a
layer's `attn` module is, its decode cache and its checkpoint module. Every mixer has one interface, x [B, S, d] ->
y [B, S, d], or with a cache (c1, .., cn, start) -> (y, (c1, .., cn)) (a pair, but for DeepSeek-V4's), so the decoder, the scanned segments
(`moejax.models.layers`: a layer's mixer is part of its kind), the cache (`moejax.infer.cache`) and the checkpoint
names (`moejax.models.hf_checkpoint`) ask the layer's mixer (`of`), never a family. A module whose cache has no
sequence axis says so (`cache_has_positions = False`), so that ExFlow's step replaces it whole rather than writing
one position (`moejax.infer.exflow`).

  attention       grouped-query or multi-head latent attention (`moejax.models.attention`); cache (k, v) or MLA's
                  (latent, rotary key), [B, S_cache, ...]; `model.layers.N.self_attn.*`
  gated_deltanet  Qwen3-Next's gated DeltaNet (`moejax.models.linear_attention`); cache (convolution inputs, state),
                  no sequence axis; `model.layers.N.linear_attn.*`
  dsa             DeepSeek sparse attention (`moejax.models.sparse_attention`): MLA whose queries see the keys a
                  lightning indexer chooses; cache (latent, rotary key beside the indexer's key); `self_attn.*`
  kimi_delta      Kimi Linear's Kimi delta attention (`moejax.models.kimi_delta_attention`): the gated DeltaNet's rule
                  with a decay per key channel; cache (convolution inputs, state), no sequence axis; `self_attn.*`
  dsa_shared      GLM-5's shared DSA layer: 'dsa' without an indexer, reusing the last 'dsa' layer's choice (the
                  layers pass a `sparse_attention.Stream` on); cache (latent, rotary key); `self_attn.*`
  deepseek_v4     DeepSeek-V4's sliding, CSA or HCA attention by the layer's type (`moejax.models.deepseek_v4_mixer`);
                  cache: the window's keys and the compressors' state, no sequence axis; `self_attn.*`
"""

import dataclasses
from typing import Callable

from moejax.models import (
  attention,
  decoder_config,
  deepseek_v4_mixer,
  kimi_delta_attention,
  linear_attention,
  sparse_attention,
)


@dataclasses.dataclass(frozen=True)
class Mixer:
  """name: a `DecoderConfig.mixers` entry. hf_module: the checkpoint's name of the module in a layer. build(cfg,
  layer, rngs=) -> the module. cache(cfg, layer, batch, length) -> ((shape, dtype), ...) of layer `layer`'s cache
  arrays for `length` positions."""

  name: str
  hf_module: str
  build: Callable
  cache: Callable


def _attention_cache(cfg, batch: int, length: int):
  return tuple((shape, cfg.dtype) for shape in attention.cache_shapes(cfg, batch, length))


def _of_layer_config(cache_specs: Callable) -> Callable:
  """A cache whose specs read only the layer's config (`DecoderConfig.at`: a sliding layer's own kv heads, MiMo)."""
  return lambda cfg, layer, batch, length: cache_specs(cfg.at(layer), batch, length)


MIXERS = {
  m.name: m
  for m in (
    Mixer("attention", "self_attn", attention.attention, _of_layer_config(_attention_cache)),
    Mixer(
      "gated_deltanet", "linear_attn", linear_attention.GatedDeltaNet, _of_layer_config(linear_attention.cache_specs)
    ),
    Mixer("dsa", "self_attn", sparse_attention.SparseAttention, _of_layer_config(sparse_attention.cache_specs)),
    Mixer(
      "kimi_delta",
      "self_attn",
      kimi_delta_attention.KimiDeltaAttention,
      _of_layer_config(kimi_delta_attention.cache_specs),
    ),
    Mixer(
      "dsa_shared",
      "self_attn",
      sparse_attention.shared_sparse_attention,
      _of_layer_config(sparse_attention.shared_cache_specs),
    ),
    Mixer("deepseek_v4", "self_attn", deepseek_v4_mixer.DeepseekV4Attention, deepseek_v4_mixer.cache_specs),
  )
}
assert tuple(MIXERS) == decoder_config.MIXERS  # the config checks the names without importing the modules


def of(cfg, layer: int) -> Mixer:
  """The token mixer of layer `layer` of a decoder config (attention for a SMILE `ModelConfig`'s layers)."""
  return MIXERS[getattr(cfg, "mixer", lambda i: "attention")(layer)]
