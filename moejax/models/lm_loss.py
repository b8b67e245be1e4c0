"""A language model's loss: its output layer's weighted cross-entropy, and the MTP modules' mean loss.

In training the output layer and the loss are one step (`moejax.train.objective.model_loss_sums`): the model hands over
the head's inputs h [B, P, d] and its kernel [d, V], and with `loss_chunk` = c > 0 the logits are computed c vocabulary
columns at a time, an online log-sum-exp carried over the chunks, so no [B, P, V] array is ever held; the backward
recomputes each chunk's logits (`jax.custom_vjp`). Chunks are over the vocabulary, not the tokens: each column of the
kernel's gradient then comes from one matmul over all tokens (the unchunked path's precision, and under data parallelism
or FSDP one reduction of it, not one per chunk), and only the gradient of h, [B, P, d] and never sharded across the
tokens' devices, is summed over the chunks (in float32). Used by the trainer (`moejax.train`) and the pipelined decoders
(`moejax.pipeline`); what the targets and weights are is `moejax.train.objective`'s.
"""

import functools

import jax
import jax.numpy as jnp

from moejax.validation import is_int, require


def cross_entropy_sums(
  logits_BxPxV: jax.Array, targets_BxP: jax.Array, weights_BxP: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted cross-entropy, weighted count of correct argmax predictions), both fp32."""
  logits_BxPxV = logits_BxPxV.astype(jnp.float32)
  log_z_BxP = jax.nn.logsumexp(logits_BxPxV, axis=-1)
  target_logit_BxP = jnp.take_along_axis(logits_BxPxV, targets_BxP[..., None], axis=-1)[..., 0]
  loss = jnp.sum((log_z_BxP - target_logit_BxP) * weights_BxP)
  correct = jnp.sum((jnp.argmax(logits_BxPxV, axis=-1) == targets_BxP) * weights_BxP)
  return loss, correct


# Vocabulary columns per chunk of the training loss (the run config's `loss_chunk`; 0: the logits at once). At 8192
# the chunk's float32 logits are 8192 x 4 bytes a token, 32 MB per 1024 tokens (DeepSeek-V3's 129,280-column logits:
# 517 MB), and each chunk is still one large matmul (tokens x d x 8192); the backward computes the head's logits once
# more (the head's matmuls from 3 to 4).
LOSS_CHUNK = 8192


def output_logits(h_BxPxD: jax.Array, kernel_DxV: jax.Array, bias_V: jax.Array | None = None) -> jax.Array:
  """The output layer: h [..., d] @ kernel [d, V] (+ bias) -> logits [..., V] fp32."""
  logits = jnp.einsum("...d,dv->...v", h_BxPxD, kernel_DxV, preferred_element_type=jnp.float32)
  return logits if bias_V is None else logits + bias_V


def head_cross_entropy_sums(
  h_BxPxD: jax.Array,
  kernel_DxV: jax.Array,
  bias_V: jax.Array | None,
  targets_BxP: jax.Array,
  weights_BxP: jax.Array,
  chunk: int,
) -> tuple[jax.Array, jax.Array]:
  """`cross_entropy_sums` of the logits `output_logits(h, kernel, bias)`, computed `chunk` vocabulary columns at a time
  (0, or a chunk as wide as V: at once). Any chunk width works: the last chunk is shifted back to end at column V and
  its columns already counted are masked. Gradients (h, kernel, bias and weights) equal the unchunked ones."""
  require(is_int(chunk, 0), "loss_chunk", chunk, "an int >= 0 (vocabulary columns per chunk of the loss; 0: at once)")
  if chunk == 0 or chunk >= kernel_DxV.shape[1]:
    return cross_entropy_sums(output_logits(h_BxPxD, kernel_DxV, bias_V), targets_BxP, weights_BxP)
  return _chunked_sums(chunk, h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP)


def _chunk_logits(chunk: int, i, h_BxPxD, kernel_DxV, bias_V):
  """Chunk i's logits [B, P, c] fp32 (columns start .. start + c - 1, start = min(i c, V - c)), its columns' ids [c],
  which of them are new (not in an earlier chunk) [c], and start."""
  start = jnp.minimum(i * chunk, kernel_DxV.shape[1] - chunk)
  cols_C = start + jnp.arange(chunk)
  bias_C = None if bias_V is None else jax.lax.dynamic_slice_in_dim(bias_V, start, chunk)
  logits_BxPxC = output_logits(h_BxPxD, jax.lax.dynamic_slice_in_dim(kernel_DxV, start, chunk, axis=1), bias_C)
  return logits_BxPxC, cols_C, cols_C >= i * chunk, start


def _num_chunks(chunk: int, kernel_DxV) -> int:
  return -(-kernel_DxV.shape[1] // chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_sums(chunk, h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP):
  return _chunked_forward(chunk, h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP)[0]


def _chunked_forward(chunk, h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP):
  """(loss sum, correct count) by an online log-sum-exp over the chunks, and what the backward reads: the inputs, the
  log-sum-exp [B, P], each token's loss and whether its argmax (the first maximum, as jnp.argmax) is the target."""

  def body(carry, i):
    max_BxP, sum_BxP, target_BxP, argmax_BxP = carry
    logits_BxPxC, cols_C, new_C, _ = _chunk_logits(chunk, i, h_BxPxD, kernel_DxV, bias_V)
    logits_BxPxC = jnp.where(new_C, logits_BxPxC, -jnp.inf)
    chunk_max_BxP = jnp.max(logits_BxPxC, axis=-1)
    new_max_BxP = jnp.maximum(max_BxP, chunk_max_BxP)
    sum_BxP = sum_BxP * jnp.exp(max_BxP - new_max_BxP) + jnp.sum(jnp.exp(logits_BxPxC - new_max_BxP[..., None]), -1)
    hit_BxPxC = (cols_C == targets_BxP[..., None]) & new_C
    target_BxP += jnp.sum(jnp.where(hit_BxPxC, logits_BxPxC, 0.0), axis=-1)
    argmax_BxP = jnp.where(chunk_max_BxP > max_BxP, cols_C[jnp.argmax(logits_BxPxC, axis=-1)], argmax_BxP)
    return (new_max_BxP, sum_BxP, target_BxP, argmax_BxP), None

  shape = targets_BxP.shape
  init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape), jnp.zeros(shape, jnp.int32))
  (max_BxP, sum_BxP, target_BxP, argmax_BxP), _ = jax.lax.scan(body, init, jnp.arange(_num_chunks(chunk, kernel_DxV)))
  log_z_BxP = max_BxP + jnp.log(sum_BxP)
  loss_BxP = log_z_BxP - target_BxP
  correct_BxP = (argmax_BxP == targets_BxP).astype(jnp.float32)
  sums = (jnp.sum(loss_BxP * weights_BxP), jnp.sum(correct_BxP * weights_BxP))
  return sums, (h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP, log_z_BxP, loss_BxP, correct_BxP)


def _chunked_backward(chunk, saved, cotangents):
  """Each chunk's logits again: d logits = (softmax - one-hot(target)) x weight x d loss, 0 at columns an earlier chunk
  had; its kernel (and bias) columns' gradient in one matmul over all tokens, written once; h's summed in float32."""
  h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP, log_z_BxP, loss_BxP, correct_BxP = saved
  d_loss, d_correct = cotangents
  scale_BxP = weights_BxP * d_loss

  def body(carry, i):
    dh_BxPxD, dkernel_DxV, dbias_V = carry
    logits_BxPxC, cols_C, new_C, start = _chunk_logits(chunk, i, h_BxPxD, kernel_DxV, bias_V)
    probs_BxPxC = jnp.where(new_C, jnp.exp(logits_BxPxC - log_z_BxP[..., None]), 0.0)
    hit_BxPxC = (cols_C == targets_BxP[..., None]) & new_C
    dlogits_BxPxC = (probs_BxPxC - hit_BxPxC) * scale_BxP[..., None]
    kernel_DxC = jax.lax.dynamic_slice_in_dim(kernel_DxV, start, chunk, axis=1)
    dh_BxPxD += jnp.einsum(
      "bpc,dc->bpd", dlogits_BxPxC.astype(kernel_DxC.dtype), kernel_DxC, preferred_element_type=jnp.float32
    )
    dkernel_DxC = jnp.einsum(
      "bpd,bpc->dc", h_BxPxD, dlogits_BxPxC.astype(h_BxPxD.dtype), preferred_element_type=jnp.float32
    )
    # Columns an earlier chunk wrote get + 0 (their d logits are 0): the sum is exact in any dtype.
    add = lambda total, part: jax.lax.dynamic_update_slice_in_dim(
      total, jax.lax.dynamic_slice_in_dim(total, start, chunk, -1) + part.astype(total.dtype), start, -1
    )
    dbias_V = None if bias_V is None else add(dbias_V, jnp.sum(dlogits_BxPxC, axis=(0, 1)))
    return (dh_BxPxD, add(dkernel_DxV, dkernel_DxC), dbias_V), None

  init = (
    jnp.zeros(h_BxPxD.shape, jnp.float32),
    jnp.zeros_like(kernel_DxV),
    None if bias_V is None else jnp.zeros_like(bias_V),
  )
  (dh_BxPxD, dkernel_DxV, dbias_V), _ = jax.lax.scan(body, init, jnp.arange(_num_chunks(chunk, kernel_DxV)))
  dweights_BxP = loss_BxP * d_loss + correct_BxP * d_correct
  return dh_BxPxD.astype(h_BxPxD.dtype), dkernel_DxV, dbias_V, None, dweights_BxP


_chunked_sums.defvjp(_chunked_forward, _chunked_backward)


def mean_over_modules(loss_sum_of, num_modules: int, targets_BxS: jax.Array, weights_BxS: jax.Array) -> jax.Array:
  """DeepSeek-V3's MTP loss (Sec. 2.2, Eq. 24-25 without lambda): the mean over the K modules of each one's weighted
  mean cross-entropy, module k (0-based) at position i predicting token i + k + 2, i.e. the next-token targets
  shifted left by k + 1 (the positions without such a token weigh 0). loss_sum_of(k, targets, weights): module k's
  weighted sum."""
  losses = []
  for k in range(num_modules):
    targets = jnp.roll(targets_BxS, -(k + 1), axis=1)
    weights = jnp.roll(weights_BxS, -(k + 1), axis=1).at[:, targets_BxS.shape[1] - k - 1 :].set(0.0)
    losses.append(loss_sum_of(k, targets, weights) / jnp.maximum(jnp.sum(weights), 1.0))
  return jnp.mean(jnp.stack(losses))


def multi_token_loss(mtp_logits_KxBxSxV: jax.Array, targets_BxS: jax.Array, weights_BxS: jax.Array) -> jax.Array:
  """The MTP loss (`mean_over_modules`) of the K modules' logits [K, B, S, V]."""
  return mean_over_modules(
    lambda k, t, w: cross_entropy_sums(mtp_logits_KxBxSxV[k], t, w)[0],
    mtp_logits_KxBxSxV.shape[0],
    targets_BxS,
    weights_BxS,
  )
