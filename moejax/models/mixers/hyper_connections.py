"""DeepSeek-V4's manifold-constrained hyper-connections (mHC; transformers' `DeepseekV4HyperConnection` and
`DeepseekV4HyperHead`) as pure functions over dicts of the modules' tensors, named and laid out as transformers
stores them (the published checkpoints' names, which transformers' conversion renames, in brackets):

  model.layers.{i}.attn_hc. and .ffn_hc.   fn [(2 + N) N, N D], base [(2 + N) N], scale [3]
                                           ([layers.{i}.hc_attn_fn, hc_attn_base, hc_attn_scale]; hc_ffn_*)
  model.hc_head.                           hc_fn [N, N D], hc_base [N], hc_scale [1]  ([hc_head_fn, ...])

The residual is N = hc_mult streams [B, S, N, D]: the embedding repeated N times (`expand`). Before each attention
or MLP block the streams, flattened to N D and RMS-normed without a weight, are projected by `fn` to per-token
weights: pre [N] (collapses the streams into the block's input), post [N] (spreads the block's output over the
streams) and comb [N, N] (mixes the streams), comb projected towards the doubly stochastic matrices by Sinkhorn-Knopp
(`mixing_weights`). The new streams are post[k] y + sum_j comb[j, k] h[j] (`merge`). After the last layer
`hyper_head` collapses the streams once more (transformers then applies the model's weighted RMSNorm).

The weights, like transformers' modules (kept in float32), are computed in float32 whatever the streams' dtype; the
collapsed input comes back in the streams' dtype, and the merge runs in the streams' dtype as transformers' decoder
layer casts post and comb to it.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from moejax.validation import is_int, is_number, require


@dataclasses.dataclass(frozen=True)
class HyperConnectionConfig:
  """N = hc_mult streams; Sinkhorn's iterations; hc_eps (the weights' floor and Sinkhorn's denominators); rms_eps
  (the unweighted RMSNorm over the flattened streams: transformers' rms_norm_eps)."""

  hc_mult: int = 4
  sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  rms_eps: float = 1e-6

  def __post_init__(self):
    require(is_int(self.hc_mult), "hc_mult", self.hc_mult, "a positive int (the number of residual streams)")
    # transformers runs one column normalisation even for 0 iterations; only 1 and more are meaningful
    require(is_int(self.sinkhorn_iters), "sinkhorn_iters", self.sinkhorn_iters, "a positive int")
    for name in ("hc_eps", "rms_eps"):
      value = getattr(self, name)
      require(is_number(value) and value >= 0, name, value, "a number >= 0")

  @property
  def num_weights(self) -> int:
    """(2 + N) N: fn's rows, pre's N, post's N and comb's N N in this order."""
    return (2 + self.hc_mult) * self.hc_mult

  @classmethod
  def from_hf(cls, config: dict) -> "HyperConnectionConfig":
    """From a DeepSeek-V4 config.json (transformers' field names and defaults)."""
    return cls(
      hc_mult=config.get("hc_mult", 4),
      sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
      hc_eps=config.get("hc_eps", 1e-6),
      rms_eps=config.get("rms_norm_eps", 1e-6),
    )


def _compute_dtype(x: jax.Array) -> jnp.dtype:
  """float32, or float64 for float64 streams (under `jax.enable_x64`)."""
  return jnp.result_type(jnp.float32, x.dtype)


def _check_streams(streams_BxSxNxD: jax.Array, cfg: HyperConnectionConfig) -> None:
  shape = tuple(streams_BxSxNxD.shape)
  require(len(shape) == 4, "streams_BxSxNxD.shape", shape, "4 axes [batch, seq, hc_mult, hidden]")
  require(shape[2] == cfg.hc_mult, "hc_mult", cfg.hc_mult, f"the streams' axis 2 has {shape[2]} (shape {shape})")


def _check_params(params: dict, names: tuple, shapes: tuple) -> None:
  """Each of `names` in `params` with its expected shape."""
  missing = [name for name in names if name not in params]
  require(not missing, "params", sorted(params), f"a dict holding {', '.join(names)} (missing {', '.join(missing)})")
  for name, want in zip(names, shapes):
    got = tuple(params[name].shape)
    require(got == want, f"{name}.shape", got, f"{want} for these streams (N = hc_mult, D = hidden size)")


def _project(streams_BxSxNxD: jax.Array, fn_OxND: jax.Array, rms_eps: float) -> jax.Array:
  """The streams flattened to N D, RMS-normed (no weight), times fn^T: [B, S, O] in the compute dtype."""
  b, s, n, d = streams_BxSxNxD.shape
  x = streams_BxSxNxD.reshape(b, s, n * d).astype(_compute_dtype(streams_BxSxNxD))
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + rms_eps)
  # HIGHEST: a TF32 dot (a GPU default) would err ~1e-3 where transformers computes in full float32
  return jnp.einsum("bsi,oi->bso", x, fn_OxND.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)


def _collapse(pre_BxSxN: jax.Array, streams_BxSxNxD: jax.Array) -> jax.Array:
  """sum_j pre[j] h[j] in the weights' dtype, back in the streams' dtype (transformers' `collapsed`)."""
  weighted = pre_BxSxN[..., None] * streams_BxSxNxD.astype(pre_BxSxN.dtype)
  return jnp.sum(weighted, axis=2).astype(streams_BxSxNxD.dtype)


def sinkhorn(logits_BxSxNxN: jax.Array, iters: int, eps: float) -> jax.Array:
  """transformers' comb projection: softmax over the last axis (rows) plus eps, then columns (axis -2) normalised,
  then iters - 1 times rows then columns, each denominator the sum plus eps. Columns come last, so each output
  stream's weights sum_j comb[j, k] are 1 (up to eps) even after one iteration; rows approach 1 with more."""
  comb = jax.nn.softmax(logits_BxSxNxN, axis=-1) + eps
  comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

  def rows_then_columns(_, m):
    m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
    return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

  # a loop, not unrolled: 20 unrolled rounds (and their gradient) cost more to compile than to run
  return jax.lax.fori_loop(0, iters - 1, rows_then_columns, comb)


def mixing_weights(params: dict, streams_BxSxNxD: jax.Array, cfg: HyperConnectionConfig):
  """transformers' `DeepseekV4HyperConnection.forward`, returning pre as well: streams_BxSxNxD ->
  (pre_BxSxN, post_BxSxN, comb_BxSxNxN in the compute dtype (float32), collapsed_BxSxD in the streams' dtype).

  `params`: the module's fn, base and scale (the module docstring). With m = fn(rmsnorm(flattened streams)) split
  into pre, post, comb (comb's N N row-major into [N, N]) and base likewise:
    pre = sigmoid(m_pre scale[0] + base_pre) + hc_eps,   post = 2 sigmoid(m_post scale[1] + base_post),
    comb = sinkhorn(m_comb scale[2] + base_comb),         collapsed = sum_j pre[j] h[j].
  """
  _check_streams(streams_BxSxNxD, cfg)
  n, d = cfg.hc_mult, streams_BxSxNxD.shape[-1]
  _check_params(params, ("fn", "base", "scale"), ((cfg.num_weights, n * d), (cfg.num_weights,), (3,)))
  mixes = _project(streams_BxSxNxD, params["fn"], cfg.rms_eps)
  base, scale = (params[name].astype(mixes.dtype) for name in ("base", "scale"))
  # one scale per group, the bias per weight: logits = m * scale[group] + base
  logits = [mixes[..., a:b] * scale[i] + base[a:b] for i, (a, b) in enumerate(((0, n), (n, 2 * n), (2 * n, None)))]
  pre = jax.nn.sigmoid(logits[0]) + cfg.hc_eps
  post = 2 * jax.nn.sigmoid(logits[1])  # no eps: post may reach 0 (and 2)
  comb = sinkhorn(logits[2].reshape(*mixes.shape[:-1], n, n), cfg.sinkhorn_iters, cfg.hc_eps)
  return pre, post, comb, _collapse(pre, streams_BxSxNxD)


def merge(post_BxSxN: jax.Array, comb_BxSxNxN: jax.Array, out_BxSxD: jax.Array, streams_BxSxNxD: jax.Array):
  """The streams after a block: new[k] = post[k] out + sum_j comb[j, k] h[j] -> [B, S, N, D].

  comb is read transposed (comb^T @ streams, transformers' `matmul(comb.transpose(-1, -2), hidden_states)`): row j
  of comb is input stream j's spread over the output streams. Sinkhorn leaves comb doubly stochastic only
  approximately and in general not symmetric, so the direction matters. post and comb are cast to the streams'
  dtype first; the N-term sum accumulates in float32 and is rounded once, as torch's half-precision matmul does
  (bit-identical in bfloat16).
  """
  dtype = streams_BxSxNxD.dtype
  n = streams_BxSxNxD.shape[2]
  require(post_BxSxN.shape[-1] == n, "post.shape", tuple(post_BxSxN.shape), f"[B, S, {n}] for {n} streams")
  require(comb_BxSxNxN.shape[-2:] == (n, n), "comb.shape", tuple(comb_BxSxNxN.shape), f"[B, S, {n}, {n}]")
  mixed = jnp.einsum(
    "bsjk,bsjd->bskd",
    comb_BxSxNxN.astype(dtype),
    streams_BxSxNxD,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=_compute_dtype(streams_BxSxNxD),
  ).astype(dtype)
  return post_BxSxN.astype(dtype)[..., None] * out_BxSxD[..., None, :] + mixed


def apply_block(
  params: dict, streams_BxSxNxD: jax.Array, block: Callable[[jax.Array], jax.Array], cfg: HyperConnectionConfig
) -> jax.Array:
  """One hyper-connected block (half of transformers' `DeepseekV4DecoderLayer.forward`): the weights from the
  streams, `block` (e.g. norm then attention; x_BxSxD -> y_BxSxD) on the collapsed input, then `merge`."""
  _, post, comb, collapsed = mixing_weights(params, streams_BxSxNxD, cfg)
  return merge(post, comb, block(collapsed), streams_BxSxNxD)


def expand(x_BxSxD: jax.Array, n: int) -> jax.Array:
  """The first layer's streams: x repeated n times along a new axis 2 -> [B, S, n, D] (transformers'
  `inputs_embeds.unsqueeze(2).expand(...)`)."""
  require(is_int(n), "hc_mult", n, "a positive int (the number of residual streams)")
  return jnp.broadcast_to(x_BxSxD[:, :, None, :], (*x_BxSxD.shape[:2], n, x_BxSxD.shape[-1]))


def hyper_head(params: dict, streams_BxSxNxD: jax.Array, cfg: HyperConnectionConfig) -> jax.Array:
  """transformers' `DeepseekV4HyperHead.forward`: streams_BxSxNxD -> x_BxSxD in the streams' dtype, collapsed by
  pre = sigmoid(hc_fn(rmsnorm(flattened streams)) hc_scale + hc_base) + hc_eps (no post, no comb, no Sinkhorn).
  `params`: hc_fn [N, N D], hc_base [N], hc_scale [1]. The model's final weighted RMSNorm is not part of it."""
  _check_streams(streams_BxSxNxD, cfg)
  n, d = cfg.hc_mult, streams_BxSxNxD.shape[-1]
  _check_params(params, ("hc_fn", "hc_base", "hc_scale"), ((n, n * d), (n,), (1,)))
  mixes = _project(streams_BxSxNxD, params["hc_fn"], cfg.rms_eps)
  scale, base = (params[name].astype(mixes.dtype) for name in ("hc_scale", "hc_base"))
  pre = jax.nn.sigmoid(mixes * scale + base) + cfg.hc_eps
  return _collapse(pre, streams_BxSxNxD)
