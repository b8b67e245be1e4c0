"""The KV cache of autoregressive decoding: one pair of arrays per block of the model, (k, v) [B, S, H, W], or for
multi-head latent attention (DeepSeek) the compressed (latent [B, S, C], rotary key [B, S, R]) (S: the cache
length, prompt + generated tokens; `moejax.models.attention.cache_shapes`).

Every sequence of a batch is at the same position (prompts of equal length), so one position
`start` says where the next tokens go. Requests are data parallel: the cache is sharded over both
mesh axes on B ('vanilla'), or every device holds all of it ('exflow': context coherence).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models import attention
from moejax.models.config import ModelConfig
from moejax.models.decoder_config import DecoderConfig
from moejax.runtime.mesh import AXES
from moejax.validation import require


def cache_sharding(mesh: jax.sharding.Mesh, coherent: bool) -> NamedSharding:
  """Requests sharded over the mesh (data parallel), or replicated on every device (coherent)."""
  return NamedSharding(mesh, P() if coherent else P(AXES))


def init_cache(cfg: ModelConfig | DecoderConfig, batch: int, length: int, mesh: jax.sharding.Mesh,
               coherent: bool = False):
  """Zeros: one pair per layer (k, v [B, S, H, W], or MLA's latent and rotary key) in the compute dtype, S = length."""
  require(cfg.causal, "kind", getattr(cfg, "kind", None), "'gpt' (a KV cache serves a causal decoder)")
  require(isinstance(length, int) and 1 <= length <= cfg.max_len, "length", length,
          f"an int in [1, max_len={cfg.max_len}] (prompt + generated tokens)")
  shapes = (attention.cache_shapes(cfg, batch, length) if isinstance(cfg, DecoderConfig) else
            ((batch, length, cfg.num_heads, cfg.d_model // cfg.num_heads),) * 2)
  sharding = cache_sharding(mesh, coherent)
  zeros = lambda shape: jax.jit(lambda: jnp.zeros(shape, jnp.dtype(cfg.dtype)), out_shardings=sharding)()
  return [tuple(zeros(shape) for shape in shapes) for _ in range(cfg.num_layers)]
