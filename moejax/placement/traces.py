"""Routing traces (ExFlow §IV-B): the experts each token is routed to at every MoE layer of a model.

The ids are the MoE layers' own routing decisions (`LanguageModel(..., details=True)` recomputes
them with the layer's router on the layer's input), so `affinity_counts(traces, E)` gives the
transitions that inference on the same tokens makes.
"""

import functools

import jax
import numpy as np
from flax import nnx

from moejax.validation import require


@functools.partial(jax.jit, static_argnames="graphdef")
def _expert_ids(params, rest, tokens_BxS, *, graphdef):
  _, aux = nnx.merge(graphdef, params, rest)(tokens_BxS, details=True)
  return aux["expert_ids"]


def routing_traces(model, batches) -> np.ndarray:
  """model: a `moejax.models.language_model.LanguageModel` with MoE layers; batches: token arrays [B, S] (B a
  multiple of the mesh's devices) -> int32 [L, T, K]: expert of choice k of token t at MoE layer j,
  tokens in batch order, then row-major (b, s) within a batch. Runs without dropout or jitter."""
  require(model.cfg.num_moe_layers >= 1, "moe_every", model.cfg.moe_every, "a model with MoE layers to trace")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  traces = [
    np.asarray(_expert_ids(params, rest, np.asarray(tokens, np.int32), graphdef=graphdef)) for tokens in batches
  ]
  require(len(traces) > 0, "batches", batches, "at least one batch of tokens")
  return np.concatenate(traces, axis=1)
