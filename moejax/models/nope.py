"""NoPE layers (`DecoderConfig.nope_layers`): attention without RoPE, and without QK-norm unless
`DecoderConfig.nope_qk_norm` (Llama 4's drop it, EXAONE-MoE's keep it); Llama 4's queries are tempered by their position where `DecoderConfig.attn_temperature` (floor_scale, attn_scale) is set
(transformers' attn_temperature_tuning, arXiv 2501.19399):

  q at position p  ->  q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1)
"""

import jax
import jax.numpy as jnp

from moejax.validation import is_number, require


def layer(cfg, i: int) -> bool:
  """Whether layer i of a decoder config is a NoPE layer (the MTP modules' blocks, i >= num_layers, never)."""
  return bool(cfg.nope_layers is not None and i < cfg.num_layers and cfg.nope_layers[i])


def temper(
  q_BxSxHxW: jax.Array, positions_S: jax.Array, floor_scale: float, attn_scale: float, offset: int = 1
) -> jax.Array:
  """q [B, S, H, W] at positions [S] times its temperature (above; Mistral 4's every query, `DecoderConfig.query_scaling`:
  offset 0, q * (1 + beta * log1p(floor(p / original_max)))), in q's dtype."""
  p_S = positions_S.astype(jnp.float32)
  scale_S = jnp.log1p(jnp.floor((p_S + offset) / floor_scale)) * attn_scale + 1.0
  return (q_BxSxHxW * scale_S[None, :, None, None]).astype(q_BxSxHxW.dtype)


def keeps_qk_norm(cfg, i: int) -> bool:
  """Whether layer i's attention QK-norms (where the config has QK-norm): every layer but a NoPE one of Llama 4's."""
  return not layer(cfg, i) or cfg.nope_qk_norm


def check(cfg) -> None:
  """nope_layers, nope_qk_norm, attn_temperature and chunked_attention of a `DecoderConfig`, refused by name."""
  require(isinstance(cfg.nope_qk_norm, bool), "nope_qk_norm", cfg.nope_qk_norm, "a bool")
  require(
    cfg.nope_layers is None or (isinstance(cfg.nope_layers, tuple) and len(cfg.nope_layers) == cfg.num_layers),
    "nope_layers",
    cfg.nope_layers,
    f"None or a tuple of {cfg.num_layers} bools",
  )
  temperature = cfg.attn_temperature
  require(
    temperature is None
    or (
      isinstance(temperature, tuple)
      and len(temperature) == 2
      and all(map(is_number, temperature))
      and temperature[0] > 0
      and cfg.nope_layers is not None
    ),
    "attn_temperature",
    temperature,
    "None, or (floor_scale > 0, attn_scale) with nope_layers (it tempers the NoPE layers' queries)",
  )
  scaling = cfg.query_scaling
  ok = isinstance(scaling, tuple) and len(scaling) == 2 and all(map(is_number, scaling)) and scaling[0] > 0
  require(scaling is None or ok, "query_scaling", scaling, "None, or (original_max > 0, beta): Mistral 4's")
  require(
    isinstance(cfg.chunked_attention, bool) and (not cfg.chunked_attention or cfg.sliding_window is not None),
    "chunked_attention",
    cfg.chunked_attention,
    "True or False; True needs sliding_window (the chunk size)",
  )
