"""Bounded receive buffers without drops: run, and while a buffer overflowed, run again with `buffer_factor`
doubled (`until_no_overflow`, the one home of that rule: the training loop's on_overflow='retry', generation's
prefill and decode steps, and `apply_without_overflow` for callers outside them, notebooks or other frameworks)."""

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply

R = TypeVar("R")


def until_no_overflow(
  run: Callable[[MoEConfig], tuple[R, int]], cfg: MoEConfig, on_retry: Callable[[int, MoEConfig], None] | None = None
) -> tuple[R, MoEConfig]:
  """(result, cfg) of the first run(cfg) -> (result, overflowed token-choices) that lost nothing, cfg's
  buffer_factor doubled before each repeat; keep the returned cfg for the next calls. on_retry(overflowed,
  new cfg) is told of each repeat before it runs. With buffer_factor None nothing can overflow and run(cfg)
  runs once. Doubling ends: at the worst-case size nothing overflows."""
  result, overflowed = run(cfg)
  while cfg.buffer_factor is not None and overflowed:
    cfg = dataclasses.replace(cfg, buffer_factor=2 * cfg.buffer_factor)
    if on_retry is not None:
      on_retry(overflowed, cfg)
    result, overflowed = run(cfg)
  return result, cfg


def apply_without_overflow(
  params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, **kwargs
) -> tuple[jax.Array, dict, MoEConfig]:
  """(y, aux, cfg) of `moe_apply` with the first buffer_factor (cfg's, doubled as often as needed)
  at which nothing overflowed; keep the returned cfg for the next calls. Eager: it reads the count.

  x: [T, D] or [B, S, D]; kwargs go to `moe_apply` (train, rng). With buffer_factor None nothing
  can overflow and this is `moe_apply`. Doubling ends: at the worst-case size nothing overflows.
  """

  def run(c):
    y, aux = moe_apply(params, x, c, mesh, **kwargs)
    return (y, aux), int(aux["tokens_overflowed"]) if c.buffer_factor is not None else 0

  (y, aux), cfg = until_no_overflow(run, cfg)
  return y, aux, cfg
