"""Causal self-attention of the decoder families, with a KV cache: grouped-query attention (qkv biases, QK-norm before
or after RoPE: `moejax.models.qk_norm`, sliding window, Qwen3-Next's output gate; projections: `projections`) and
DeepSeek's multi-head latent attention, whose cache holds the compressed latent and the shared rotary key.

Both take x [B, S, d] at positions start .. start + S - 1 and, with a cache (c1, c2, start), write the new entries
there and attend over the cache (entries not written yet lie after every query, so stay hidden); they return the
output, or (output, (c1, c2)). Parameters keep the checkpoints' names (q_proj, kv_a_proj_with_mqa, ...); a kernel
is the transpose of a torch Linear weight. The softmax itself is `attend`: `jax.nn.dot_product_attention` (XLA or
cuDNN's fused kernel) or tokamax's, as `DecoderConfig.attention_impl` says (`resolve_impl`).
"""

import functools
import importlib.util
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from moejax.models import masks, mup, nope, qk_norm, rope
from moejax.models.decoder_config import DecoderConfig
from moejax.models.projections import gqa_linears, linear, project_qkv, qk_norms
from moejax.models.rms_norm import RMSNorm
from moejax.validation import require

CUDNN_DTYPES = ("bfloat16",)  # of DecoderConfig's dtypes
TOKAMAX_MISSING = "tokamax installed (Python >= 3.12, jax >= 0.11.1), or 'xla', 'cudnn' or 'auto'"
LATENT_EPS = 1e-6  # MLA's q_a / kv_a RMSNorms: transformers' and DeepSeek's default eps, not rms_norm_eps (GLM-4.7)


def _write(cache: jax.Array, new: jax.Array, start) -> jax.Array:
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=1)


def cudnn_refusal(dtype: str, width: int, sinks: bool, device: jax.Device, platform: str | None = None) -> str | None:
  """Why cuDNN's fused attention cannot run a layer computing in `dtype` with heads `width` wide (q, k and v, v
  padded to q's) on `device` of `platform` (default: the device's own), or None when it can: the rules of jax's
  `check_is_flash_attention` (`cudnn_rules`), then `cudnn_probe` on the device itself."""
  platform = platform or device.platform
  if platform != "gpu":
    return f"cuDNN runs on CUDA GPUs, this is a {platform} device"
  try:
    capability = tuple(int(part) for part in device.compute_capability.split("."))
  except (AttributeError, ValueError):
    return f"cuDNN runs on CUDA GPUs, this is {device.device_kind!r}"
  return cudnn_rules(dtype, width, sinks, capability) or cudnn_probe(device, width)


def cudnn_rules(dtype: str, width: int, sinks: bool, capability: tuple[int, int]) -> str | None:
  """Why cuDNN's flash attention cannot run the layer on a CUDA GPU of compute `capability`, by the rules of jax's
  `check_is_flash_attention` alone (16-bit inputs; a head width a multiple of 8, at most 256 from Hopper (9.0) on
  and 128 before; and no sinks), or None. No trial run: what the memory planner asks of a planned GPU."""
  if dtype not in CUDNN_DTYPES:
    return f"cuDNN's flash attention takes 16-bit inputs, the model computes in dtype={dtype!r}"
  limit = 256 if capability >= (9, 0) else 128
  if width % 8 or width > limit:
    at = ".".join(map(str, capability))
    return f"cuDNN takes heads a multiple of 8 and at most {limit} wide on compute capability {at}, these are {width}"
  if sinks:
    return "attention sinks are a bias over every query and key, which cuDNN reads materialised [H, S, S]"
  return None


@functools.lru_cache
def cudnn_probe(device: jax.Device, width: int) -> str | None:
  """Runs cuDNN's attention once on `device` at tiny sizes with heads `width` wide, as the modules call it (causal,
  forward and backward; one query over a masked cache): None, or why it failed. The rules alone do not tell: under
  CUDA 13 cuDNN has been seen to build no execution plan for any attention (jax issue 32430; jax's own tests skip
  cuDNN there). Once per device and width; concrete even while a model is traced."""
  attend_ = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
  try:
    with jax.ensure_compile_time_eval():
      q, kv = (jax.device_put(np.ones((1, 128, 1, width), jnp.bfloat16), device) for _ in range(2))
      loss = lambda q, kv: jnp.sum(attend_(q, kv, kv, is_causal=True).astype(jnp.float32))
      jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv))
      step = lambda q, kv: attend_(q, kv, kv, mask=np.arange(128)[None, None, None, :] < 100)
      jax.block_until_ready(jax.jit(step)(q[:, :1], kv))
  except Exception as e:  # pylint: disable=broad-except  # whatever cuDNN or XLA raise: the reason to fall back
    logging.warning("cuDNN attention does not run on %s at head width %d: %s", device, width, e)
    return f"cuDNN's attention failed a trial run on this device ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
  return None


class Implementation(NamedTuple):
  """A value of `DecoderConfig.attention_impl` but 'auto': its name, its call (q, k, v, jax.nn's options), where it
  runs (`refusal`: (dtype, width, sinks, device, platform) -> None, or what to choose instead and why)."""

  name: str
  run: Callable
  keeps_scores: bool  # the backward keeps the softmax's scores (XLA's, materialised), not only their log-sum-exp
  pads_values: bool = True  # v and the output run padded to q's width (jax.nn's attention takes v of k's shape)
  refusal: Callable = lambda dtype, width, sinks, device, platform: None  # runs everywhere
  instead: str = ""  # the refusal's prefix: what to choose instead


_tokamax = lambda *qkv, **options: importlib.import_module("tokamax").dot_product_attention(*qkv, **options)
_no_tokamax = lambda *_: None if importlib.util.find_spec("tokamax") else TOKAMAX_MISSING  # optional: imported to run
_jax_nn = lambda impl: functools.partial(jax.nn.dot_product_attention, implementation=impl)  # XLA's or cuDNN's
IMPLEMENTATIONS = {
  i.name: i
  for i in (
    Implementation("xla", _jax_nn("xla"), keeps_scores=True),
    Implementation("cudnn", _jax_nn("cudnn"), False, refusal=cudnn_refusal, instead="'xla' or 'auto' here: "),
    Implementation("tokamax", _tokamax, keeps_scores=False, pads_values=False, refusal=_no_tokamax),
  )
}
AUTO, AUTO_ORDER = "auto", ("cudnn", "xla")  # 'auto': the first of AUTO_ORDER that runs the layer on the device


def resolve_impl(impl: str, dtype: str, width: int, sinks: bool = False, device=None, platform: str | None = None):
  """The implementation to run on `device` (default: this process's first) of `platform` (default: its own): 'auto'
  the first of AUTO_ORDER that runs the layer there (`cudnn_refusal`), else 'xla'; one that cannot is refused naming
  `attention_impl`, when the model is built (before its forward is traced)."""
  device = device or jax.local_devices()[0]
  runs = lambda name: IMPLEMENTATIONS[name].refusal(dtype, width, sinks, device, platform or device.platform)
  if impl == AUTO:
    return next(name for name in AUTO_ORDER if runs(name) is None)
  why_not = runs(impl)
  require(why_not is None, "attention_impl", impl, f"{IMPLEMENTATIONS[impl].instead}{why_not}")
  return impl


def planned(impl: str, dtype: str, width: int, capability: tuple[int, int]) -> Implementation:
  """What a layer runs on a planned CUDA GPU of compute `capability`: 'auto' as `resolve_impl`, by cuDNN's rules."""
  if impl == AUTO:
    impl = "xla" if cudnn_rules(dtype, width, False, capability) else "cudnn"
  return IMPLEMENTATIONS[impl]


def attend(
  q_BxSxHxW,
  k_BxSxHxW,
  v_BxSxHxW,
  impl: str,
  scale: float,
  window: int | None = None,
  query_positions_S=None,
  sinks_H=None,
  chunked: bool = False,
) -> jax.Array:
  """Causal softmax attention: q [B, S, H, W] over keys k [B, S_keys, H_kv, W] and values v [B, S_keys, H_kv, W_v]
  (H_kv divides H: query head i reads key/value head i // (H / H_kv); W_v may differ from W, as in MLA) ->
  [B, S, H, W_v], by `impl` ('xla', 'cudnn', 'tokamax'; `resolve_impl`), the logits times `scale`.

  Without query_positions the queries are the keys themselves, positions 0 .. S - 1 (training, scoring), and the
  library masks them (is_causal, local_window_size), so that cuDNN skips the hidden blocks. With query_positions [S]
  (a KV cache, whose slot t holds position t) the key at t is visible to the query at p iff t <= p, which also hides
  the slots not written yet; both ways p - t < window too (chunked: t in p's chunk, `masks.visible`). sinks [H]: one logit per head in the softmax's
  denominator and no value (gpt-oss), an extra key of zero key and value whose logit is the bias.
  """
  (b, s, h, _), keys, width = q_BxSxHxW.shape, k_BxSxHxW.shape[1], v_BxSxHxW.shape[-1]
  dtype = q_BxSxHxW.dtype
  k_BxSxHxW, v_BxSxHxW = k_BxSxHxW.astype(dtype), v_BxSxHxW.astype(dtype)
  if IMPLEMENTATIONS[impl].pads_values:  # jax.nn takes v of k's shape only: zeros widen the narrower, q.k, p v alike
    wide = max(q_BxSxHxW.shape[-1], width)
    widen = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, wide - a.shape[-1]),))
    q_BxSxHxW, k_BxSxHxW, v_BxSxHxW = widen(q_BxSxHxW), widen(k_BxSxHxW), widen(v_BxSxHxW)
  mask_1x1xSxS = bias_1xHx1xS = None
  if query_positions_S is not None or sinks_H is not None or (chunked and window is not None):
    query_positions_S = jnp.arange(s) if query_positions_S is None else query_positions_S
    mask_1x1xSxS = masks.visible(query_positions_S, keys, window, chunked)[None, None]
  if sinks_H is not None:
    zero_Bx1xHxW = jnp.zeros((b, 1, *k_BxSxHxW.shape[2:]), dtype)
    k_BxSxHxW = jnp.concatenate([k_BxSxHxW, zero_Bx1xHxW], axis=1)
    v_BxSxHxW = jnp.concatenate([v_BxSxHxW, jnp.zeros((b, 1, *v_BxSxHxW.shape[2:]), dtype)], axis=1)
    mask_1x1xSxS = jnp.concatenate([mask_1x1xSxS, jnp.ones((1, 1, s, 1), bool)], axis=-1)
    bias_1xHx1xS = jnp.concatenate(
      [jnp.zeros((1, h, 1, keys), jnp.float32), sinks_H.astype(jnp.float32)[None, :, None, None]], axis=-1
    )
  own_masks = mask_1x1xSxS is None
  local = (window - 1, 0) if own_masks and window is not None else None
  options = dict(bias=bias_1xHx1xS, mask=mask_1x1xSxS, scale=scale, is_causal=own_masks, local_window_size=local)
  out_BxSxHxW = IMPLEMENTATIONS[impl].run(q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, **options)
  return out_BxSxHxW[..., :width]


class GroupedQueryAttention(nnx.Module):
  """Attention with num_kv_heads key/value heads, each shared by num_heads / num_kv_heads query heads, and with
  attention_sinks a learned logit per head (`sinks [num_heads]`, gpt-oss); the cache holds (k, v) [B, S_cache,
  num_kv_heads, head_dim or v_head_dim]. A sliding-window layer reads its own fields (`DecoderConfig.at`)."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs):
    cfg = cfg.at(layer)  # MiMo-V2-Flash's sliding layers: their kv heads, sinks and RoPE
    self.cfg, self.window = cfg, cfg.window(layer)
    self.q_proj, self.k_proj, self.v_proj, self.o_proj = gqa_linears(cfg, rngs)
    self.nope = nope.layer(cfg, layer)  # NoPE layers: no RoPE (Llama 4's: no QK-norm, tempered queries)
    self.q_norm, self.k_norm = qk_norms(cfg) if nope.keeps_qk_norm(cfg, layer) else (None, None)
    self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), jnp.dtype(cfg.param_dtype))) if cfg.attention_sinks else None
    self.inverse, self.factor = ((), 1.0) if self.nope else rope.frequencies(cfg.rope_dim, cfg.rope_theta, cfg.scaling)
    self.impl = resolve_impl(cfg.attention_impl, cfg.dtype, max(cfg.head_dim, cfg.value_dim), cfg.attention_sinks)

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    cfg = self.cfg
    (b, s, _), h = x_BxSxD.shape, cfg.num_heads
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    # k, v: [B, S, num_kv_heads, W] (their own head count), then [B, S_cache, ...] with a cache.
    q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, gate_BxSxHW = project_qkv(self, x_BxSxD)
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q_BxSxHxW, k_BxSxHxW = rotate(q_BxSxHxW), rotate(k_BxSxHxW)
    # HunYuan's QK-norm acts on the rotated heads: keys are cached normed, as transformers caches them
    q_BxSxHxW, k_BxSxHxW = qk_norm.of(cfg).apply(qk_norm.AFTER_ROPE, self.q_norm, self.k_norm, q_BxSxHxW, k_BxSxHxW)
    if self.nope and cfg.attn_temperature is not None:
      q_BxSxHxW = nope.temper(q_BxSxHxW, positions_S, *cfg.attn_temperature)
    if cfg.query_scaling is not None:  # Mistral 4's, every layer's
      q_BxSxHxW = nope.temper(q_BxSxHxW, positions_S, *cfg.query_scaling, offset=0)
    if cache is not None:
      k_BxSxHxW, v_BxSxHxW = _write(cache[0], k_BxSxHxW, start), _write(cache[1], v_BxSxHxW, start)
    out_BxSxHxW = attend(
      q_BxSxHxW,
      k_BxSxHxW,
      v_BxSxHxW,
      self.impl,
      mup.softmax_scale(cfg),
      self.window,
      None if cache is None else positions_S,
      None if self.sinks is None else self.sinks[...],
      cfg.chunked_attention,
    )
    out_BxSxHW = out_BxSxHxW.reshape(b, s, h * cfg.value_dim)
    if gate_BxSxHW is not None:  # gated attention (Qwen3-Next): each output dimension gated before o_proj
      out_BxSxHW = out_BxSxHW * jax.nn.sigmoid(gate_BxSxHW).astype(out_BxSxHW.dtype)
    out_BxSxD = self.o_proj(out_BxSxHW)
    return out_BxSxD if cache is None else (out_BxSxD, (k_BxSxHxW, v_BxSxHxW))


class LatentAttention(nnx.Module):
  """DeepSeek's multi-head latent attention: q through an optional low-rank latent, keys and values from one
  compressed latent [kv_lora_rank] (RMS-normed) and a rotary key [qk_rope_head_dim] shared by every head; the cache
  holds (latent [B, S_cache, kv_lora_rank], rotary key [B, S_cache, qk_rope_head_dim])."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.window = cfg, cfg.window(layer)
    h, d, pd = cfg.num_heads, cfg.d_model, jnp.dtype(cfg.param_dtype)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
      self.q_proj = linear(cfg, d, h * qk, False, rngs)
    else:
      self.q_a_proj = linear(cfg, d, cfg.q_lora_rank, False, rngs)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_EPS, pd)
      self.q_b_proj = linear(cfg, cfg.q_lora_rank, h * qk, False, rngs)
    self.kv_a_proj_with_mqa = linear(cfg, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, False, rngs)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_EPS, pd)
    self.kv_b_proj = linear(cfg, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, rngs)
    self.o_proj = linear(cfg, h * cfg.v_head_dim, d, False, rngs)
    # a NoPE layer (Kimi Linear's MLA): the key's rotary part is still shared by the heads, but not rotated
    rotary = None if nope.layer(cfg, layer) else (cfg.qk_rope_head_dim, cfg.rope_theta, cfg.scaling)
    self.inverse, self.factor = ((), 1.0) if rotary is None else rope.frequencies(*rotary)
    self.scale = rope.softmax_scale(qk, cfg.scaling)
    self.impl = resolve_impl(cfg.attention_impl, cfg.dtype, max(qk, cfg.v_head_dim))  # v padded to q's width

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    """Widths: a head's q and k qk_nope_head_dim + qk_rope_head_dim (W here), its v v_head_dim; `latent` [B, S,
    kv_lora_rank] and `rotary_key` [B, S, qk_rope_head_dim] are what the cache keeps ([B, S_cache, ...] with one)."""
    cfg = self.cfg
    (b, s, _), h, w_nope, r = x_BxSxD.shape, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    start = 0 if cache is None else cache[2]
    positions_S = start + jnp.arange(s)
    q = self.q_proj(x_BxSxD) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BxSxD)))
    q_BxSxHxW = q.reshape(b, s, h, w_nope + r)
    compressed = self.kv_a_proj_with_mqa(x_BxSxD)
    latent, rotary_key = self.kv_a_layernorm(compressed[..., : cfg.kv_lora_rank]), compressed[..., cfg.kv_lora_rank :]
    rotate = lambda a: rope.rotate(a, positions_S, self.inverse, self.factor, cfg.rope_interleaved)
    q_rope, rotary_key = rotate(q_BxSxHxW[..., w_nope:]), rotate(rotary_key[:, :, None])[:, :, 0]  # one head for all
    if cache is not None:
      latent, rotary_key = _write(cache[0], latent, start), _write(cache[1], rotary_key, start)
    keys = latent.shape[1]
    # Each head's non-rotary key and its value from the latent: [B, S_keys, H, qk_nope_head_dim + v_head_dim].
    kv_BxSxHxW = self.kv_b_proj(latent.astype(x_BxSxD.dtype)).reshape(b, keys, h, w_nope + cfg.v_head_dim)
    k_BxSxHxW = jnp.concatenate(
      [kv_BxSxHxW[..., :w_nope], jnp.broadcast_to(rotary_key[:, :, None].astype(kv_BxSxHxW.dtype), (b, keys, h, r))],
      axis=-1,
    )
    q_BxSxHxW = jnp.concatenate([q_BxSxHxW[..., :w_nope], q_rope], axis=-1)
    if cfg.query_scaling is not None:  # Mistral 4's, every layer's
      q_BxSxHxW = nope.temper(q_BxSxHxW, positions_S, *cfg.query_scaling, offset=0)
    out_BxSxHxW = attend(
      q_BxSxHxW,
      k_BxSxHxW,
      kv_BxSxHxW[..., w_nope:],
      self.impl,
      self.scale,
      self.window,
      None if cache is None else positions_S,
    )
    out_BxSxD = self.o_proj(out_BxSxHxW.reshape(b, s, h * cfg.v_head_dim))
    return out_BxSxD if cache is None else (out_BxSxD, (latent, rotary_key))


def attention(cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs) -> nnx.Module:
  return (LatentAttention if cfg.latent else GroupedQueryAttention)(cfg, layer, rngs=rngs)


def cache_shapes(cfg: DecoderConfig, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The two cache arrays of one layer: (k, v) or MLA's (latent, rotary key), `length` positions."""
  if cfg.latent:
    return (batch, length, cfg.kv_lora_rank), (batch, length, cfg.qk_rope_head_dim)
  return (batch, length, cfg.num_kv_heads, cfg.head_dim), (batch, length, cfg.num_kv_heads, cfg.value_dim)
