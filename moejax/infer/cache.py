"""The KV cache of autoregressive decoding: one (k, v) pair [B, S, H, W] per block of the model
(S: the cache length, prompt + generated tokens).

Every sequence of a batch is at the same position (prompts of equal length), so one position
`start` says where the next tokens go. Requests are data parallel: the cache is sharded over both
mesh axes on B ('vanilla'), or every device holds all of it ('exflow': context coherence).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models.config import ModelConfig
from moejax.runtime.mesh import AXES
from moejax.validation import require


def cache_sharding(mesh: jax.sharding.Mesh, coherent: bool) -> NamedSharding:
  """Requests sharded over the mesh (data parallel), or replicated on every device (coherent)."""
  return NamedSharding(mesh, P() if coherent else P(AXES))


def init_cache(cfg: ModelConfig, batch: int, length: int, mesh: jax.sharding.Mesh, coherent: bool = False):
  """Zeros: [(k [B, S, H, W], v [B, S, H, W])] * num_layers in the compute dtype, S = length."""
  require(cfg.kind == "gpt", "kind", cfg.kind, "'gpt' (a KV cache serves a causal decoder)")
  require(isinstance(length, int) and 1 <= length <= cfg.max_len, "length", length,
          f"an int in [1, max_len={cfg.max_len}] (prompt + generated tokens)")
  shape = (batch, length, cfg.num_heads, cfg.d_model // cfg.num_heads)
  sharding = cache_sharding(mesh, coherent)
  zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(cfg.dtype)), out_shardings=sharding)
  return [(zeros(), zeros()) for _ in range(cfg.num_layers)]
