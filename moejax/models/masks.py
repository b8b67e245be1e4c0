"""Which keys a causal query sees, as a boolean mask (`moejax.models.attention.attend` builds one where the
library's own causal and local-window masks do not say it): causal, within a sliding window (Mixtral, gpt-oss,
MiMo-V2-Flash) or within the query's chunk (Llama 4's chunked attention, `DecoderConfig.chunked_attention`)."""

import jax
import jax.numpy as jnp


def visible(query_positions_S: jax.Array, keys: int, window: int | None, chunked: bool = False) -> jax.Array:
  """[S, keys] bool: the key at position t (a cache's slot t, or the t-th key) visible to the query at p (of
  query_positions [S]) iff t <= p and, with a window, p - t < window (sliding) or, chunked, p // window == t //
  window (the positions cut in chunks of `window`: transformers' chunked_overlay). t <= p also hides a cache's
  slots not written yet."""
  key_positions_K = jnp.arange(keys)
  behind_SxK = query_positions_S[:, None] - key_positions_K[None, :]
  visible_SxK = behind_SxK >= 0
  if window is not None and chunked:
    visible_SxK &= query_positions_S[:, None] // window == key_positions_K[None, :] // window
  elif window is not None:
    visible_SxK &= behind_SxK < window
  return visible_SxK
