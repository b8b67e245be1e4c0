"""Rotary position embeddings (RoPE) as today's decoders use them: the frequencies, plain or YaRN-scaled (the
context extension of DeepSeek-V2/V3), and the rotation of a head's rotary part, half-split (Llama, Mixtral, Qwen)
or in interleaved pairs (DeepSeek's checkpoints). Computed in float32, as transformers does."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from moejax.validation import require

ROPE_TYPES = ("default", "yarn", "llama3")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(dim: int, theta: float, scaling: dict | None = None) -> tuple[tuple[float, ...], float]:
  """(inverse frequencies [dim / 2] (float32 values; a tuple, so modules keep it as static configuration), the
  factor on cos and sin) of a rotary part `dim` wide.

  scaling: a checkpoint's rope_scaling (None or type 'default': plain RoPE; 'yarn': YaRN's blend of interpolated
  and extrapolated frequencies between beta_fast and beta_slow rotations, and its attention factor; 'llama3':
  `_llama3`)."""
  exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
  extrapolated = (1.0 / np.float32(theta) ** exponents).astype(np.float32)
  kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
  require(kind in ROPE_TYPES, "rope_scaling.rope_type", kind, f"one of {ROPE_TYPES}")
  if kind == "default":
    return tuple(map(float, extrapolated)), 1.0
  if kind == "llama3":
    return _llama3(extrapolated, scaling), 1.0
  factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
  mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    attention_factor = (
      _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
      if mscale and mscale_all_dim
      else _yarn_mscale(factor)
    )
  beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
  correction = lambda rotations: dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = correction(beta_fast), correction(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
  keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
  inverse = extrapolated / np.float32(factor) * (1 - keep) + extrapolated * keep
  return tuple(map(float, inverse.astype(np.float32))), float(attention_factor)


def _llama3(inverse: np.ndarray, scaling: dict) -> tuple[float, ...]:
  """Llama 3's (and Llama 4's) frequencies: those of wavelengths past original / low_freq_factor divided by factor,
  those under original / high_freq_factor kept, the ones between blended smoothly (transformers' llama3 rope)."""
  factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
  original = float(scaling["original_max_position_embeddings"])
  wavelength = 2 * math.pi / inverse
  scaled = np.where(wavelength > original / low, inverse / factor, inverse)
  with np.errstate(divide="ignore", invalid="ignore"):  # high == low (Scout's 1 and 1): no blended band
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelength >= original / high) & (wavelength <= original / low)
  return tuple(map(float, np.where(medium, blended, scaled).astype(np.float32)))


def softmax_scale(head_dim: int, scaling: dict | None) -> float:
  """The attention logits' scale: head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 where a checkpoint
  sets mscale_all_dim (DeepSeek-V2/V3)."""
  scale = head_dim**-0.5
  if (
    scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim")
  ):
    scale *= _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
  return scale


def rotate(
  x_BxSxHxW: jax.Array, positions_S: jax.Array, inverse: tuple[float, ...], factor: float, interleaved: bool
) -> jax.Array:
  """x [B, S, H, W] at positions [S] -> rotated, in x's dtype; inverse: the frequencies [R / 2] (`frequencies`) of
  the rotary part, x's first R dimensions (all of them, or GLM-4.5's partial RoPE: the rest pass unchanged).
  Half-split pairs dimension i with i + R/2; interleaved pairs 2i with 2i + 1 and returns the evens' results then
  the odds' (a fixed permutation of the rotary part, the same for queries and keys, so their dot products are the
  checkpoint's)."""
  angles = positions_S.astype(jnp.float32)[:, None] * jnp.asarray(inverse, jnp.float32)[None, :]  # [S, R / 2]
  cos, sin = (f(angles)[None, :, None, :] * factor for f in (jnp.cos, jnp.sin))
  rotary = 2 * len(inverse)
  x = x_BxSxHxW[..., :rotary].astype(jnp.float32)
  half = rotary // 2
  first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return jnp.concatenate([rotated.astype(x_BxSxHxW.dtype), x_BxSxHxW[..., rotary:]], axis=-1)
