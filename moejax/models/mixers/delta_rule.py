"""The gated delta rule (Yang et al., "Gated Delta Networks", 2024) as transformers' Qwen3-Next computes it.

Per value head, with the state S [K, V], decay g_t <= 0 (log space), beta_t in (0, 1) and q_t scaled by 1/sqrt(K):

  S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,    o_t = S_t^T q_t

(the decay acts before the state is read: `torch_recurrent_gated_delta_rule`). The decay is one per head (g_t [H]:
Qwen3-Next's gated DeltaNet) or one per key channel (g_t [H, K], exp(g_t) S_{t-1} scaling row k of S by exp(g_t[k]):
Kimi Linear's KDA, `chunk_kimi_delta_attention`), the same rule: a head's decay is its channels' all equal, width 1
broadcast over K. q and k have num_k_heads heads, v, g and beta num_v_heads; k head i serves the value heads i * r .. i * r + r - 1 (r = num_v_heads / num_k_heads,
`repeat_interleave`). q and k come in already L2-normalised (the mixer does it; transformers does it inside the
rule). Everything runs in float32 (float64 inputs under `jax.enable_x64` in float64); the output comes back in
q's dtype, the state stays in that compute dtype.
"""

import jax
import jax.numpy as jnp


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
  """einsum at full float32 precision: a TF32 dot (a GPU default) errs ~1e-3, which the recurrence carries on."""
  return jnp.einsum(spec, *xs, precision=jax.lax.Precision.HIGHEST)


def _wide(*xs) -> jnp.dtype:
  """The compute dtype: float32, or float64 where an input is (the tests' float64 reference runs)."""
  return jnp.result_type(jnp.float32, *(x.dtype for x in xs))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x [..., n] / sqrt(sum(x^2) + eps) in float32 (transformers' and FLA's `l2norm`: eps inside the root)."""
  x = x.astype(_wide(x))
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, initial_state):
  """q, k [B, S, Hk, K] -> [B, S, H, K] repeated per value head, all in the compute dtype, q scaled by 1/sqrt(K);
  g [B, S, H] -> [B, S, H, 1] (a decay per head: the per-channel rule's width-1 case), [B, S, H, K] as it is; the
  state [B, H, K, V] (zeros when None)."""
  b, _, h, v_dim = v.shape
  dtype = _wide(q, k, v, g, beta)
  rep = h // k.shape[2]
  q, k = (jnp.repeat(x, rep, axis=2) for x in (q, k))
  q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
  g = g[..., None] if g.ndim == 3 else g
  if initial_state is None:
    initial_state = jnp.zeros((b, h, k.shape[-1], v_dim), dtype)
  return q * k.shape[-1] ** -0.5, k, v, g, beta, initial_state.astype(dtype)


def _decayed_products(x, y, cum):
  """[i, j] = sum_k x_i[k] y_j[k] exp(cum_i[k] - cum_j[k]) for i >= j, 0 above: x, y [B, H, C, K], cum [B, H, C, G]
  (G = 1: one decay per head, which factors out of the sum, a [C, C] matrix; G = K: per channel, [C, C, K]). The
  exponent is masked before exp so that the upper triangle never overflows."""
  c = cum.shape[-2]
  causal = jnp.tril(jnp.ones((c, c), bool))
  if cum.shape[-1] == 1:
    decay = jnp.exp(jnp.where(causal, cum[..., :, None, 0] - cum[..., None, :, 0], -jnp.inf))
    return _mm("bhik,bhjk->bhij", x, y) * decay
  decay = jnp.exp(jnp.where(causal[..., None], cum[..., :, None, :] - cum[..., None, :, :], -jnp.inf))
  return _mm("bhik,bhjk,bhijk->bhij", x, y, decay)


def _chunk_step(state_BxHxKxV, xs):
  """One chunk of C tokens: its output from the state before it plus the chunk's own tokens, then the state after.
  xs: q, k [B, H, C, K], v [B, H, C, V], g [B, H, C, G] (G: 1 or K), beta [B, H, C]."""
  q, k, v, g, beta = xs
  cum = jnp.cumsum(g, axis=-2)  # log of the decay from the chunk's start to each position (per channel)
  k_beta = k * beta[..., None]
  # UT transform: the chunk's C delta updates as one unit lower triangular solve (I + A) [u | w] = [beta v | ...]
  # with A the strictly lower beta_i k_i . k_j decayed from j to i; u: the values written, w: the keys reading the
  # old state.
  a = jnp.tril(_decayed_products(k_beta, k, cum), -1)
  rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)], axis=-1)
  uw = jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
  u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1] :]
  v_new = u - _mm("bhck,bhkv->bhcv", w, state_BxHxKxV)  # the correction the old state does not predict
  attn = _decayed_products(q, k, cum)
  o = _mm("bhck,bhkv->bhcv", q * jnp.exp(cum), state_BxHxKxV) + _mm("bhij,bhjv->bhiv", attn, v_new)
  last = cum[..., -1:, :]
  k_to_end = k * jnp.exp(last - cum)
  state = state_BxHxKxV * jnp.exp(last[..., 0, :])[..., None] + _mm("bhck,bhcv->bhkv", k_to_end, v_new)
  return state, o


def chunked_gated_delta_rule(q, k, v, g, beta, chunk: int = 64, initial_state=None):
  """The gated delta rule over chunks of `chunk` tokens (transformers' `torch_chunk_gated_delta_rule`, the WY / UT
  form): a `lax.scan` over the chunks, each chunk's work in matmuls, so memory is O(chunk^2) per head, not O(S^2).

  q_BxSxHkxK, k_BxSxHkxK (L2-normalised), v_BxSxHxV, g_BxSxH or g_BxSxHxK (log decay, <= 0, per head or per key
  channel), beta_BxSxH, initial_state_BxHxKxV
  (None: zeros) -> (o_BxSxHxV in q's dtype, final_state_BxHxKxV float32, or float64 for float64 inputs). S need
  not be a multiple of `chunk`: the tail is padded with k = v = beta = g = 0 tokens, which leave the state as it is.
  """
  out_dtype, (b, s, h, v_dim) = q.dtype, v.shape
  q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state)
  c = min(chunk, s)
  pad = -s % c
  n = (s + pad) // c

  def chunks(x):  # [B, S, H, ...] -> [N, B, H, C, ...], the scan's leading axis first
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, c, *x.shape[2:])
    return jnp.moveaxis(x, (1, 2), (0, 3))

  state, o = jax.lax.scan(_chunk_step, state, tuple(chunks(x) for x in (q, k, v, g, beta)))
  o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, n * c, h, v_dim)[:, :s]
  return o.astype(out_dtype), state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
  """The gated delta rule token by token (transformers' `torch_recurrent_gated_delta_rule`): decoding, one token
  (or a few) at a time from a state. Same arguments and results as `chunked_gated_delta_rule`."""
  out_dtype = q.dtype
  q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state)

  def step(state_BxHxKxV, xs):
    q_t, k_t, v_t, g_t, beta_t = xs  # [B, H, K], [B, H, K], [B, H, V], [B, H, G], [B, H]
    state_BxHxKxV = state_BxHxKxV * jnp.exp(g_t)[..., None]  # row k of the state by its channel's decay
    delta = (v_t - _mm("bhk,bhkv->bhv", k_t, state_BxHxKxV)) * beta_t[..., None]
    state_BxHxKxV = state_BxHxKxV + k_t[..., :, None] * delta[..., None, :]
    return state_BxHxKxV, _mm("bhk,bhkv->bhv", q_t, state_BxHxKxV)

  state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
  return jnp.moveaxis(o, 0, 1).astype(out_dtype), state
