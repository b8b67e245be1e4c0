"""Bounded receive buffers without drops, for callers outside the trainer (notebooks, other
frameworks): run the layer, and while a buffer overflowed, run it again with `buffer_factor` doubled.
The trainer does the same per step (`moejax.train.loop`)."""

import dataclasses

import jax

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply


def apply_without_overflow(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh,
                           **kwargs) -> tuple[jax.Array, dict, MoEConfig]:
  """(y, aux, cfg) of `moe_apply` with the first buffer_factor (cfg's, doubled as often as needed)
  at which nothing overflowed; keep the returned cfg for the next calls. Eager: it reads the count.

  x: [T, D] or [B, S, D]; kwargs go to `moe_apply` (train, rng). With buffer_factor None nothing
  can overflow and this is `moe_apply`. Doubling ends: at the worst-case size nothing overflows.
  """
  while True:
    y, aux = moe_apply(params, x, cfg, mesh, **kwargs)
    if cfg.buffer_factor is None or int(aux["tokens_overflowed"]) == 0:
      return y, aux, cfg
    cfg = dataclasses.replace(cfg, buffer_factor=2 * cfg.buffer_factor)
