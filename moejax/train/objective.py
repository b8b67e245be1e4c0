"""What the models learn to predict: BERT masking for the MLM, next tokens for the causal LM.

Both objectives turn a batch of token ids into inputs, the positions to predict, their targets and
weights; the model computes logits only at those positions (for the MLM, the masked ones: 15% of
the vocabulary projection's cost), and the loss is the weighted mean cross-entropy. Randomness
comes from one key per step, so masks are identical however the batch is sharded or split across
processes.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """The ids the objectives need, without a tokenizer (a `moejax.data.tokenizer.Tokenizer` has the same
  attributes): ordinary ids are [first_ordinary, first_ordinary + num_ordinary), all ids < num_ids."""

  pad_id: int
  mask_id: int
  first_ordinary: int
  num_ordinary: int
  num_ids: int


MASK_PROB = 0.15  # BERT's


def num_predictions(seq_len: int, mask_prob: float = MASK_PROB) -> int:
  """P, the positions `bert_mask` selects per sequence of seq_len tokens (the MLM head runs on these)."""
  return max(1, round(mask_prob * seq_len))


def bert_mask(key: jax.Array, tokens_BxS: jax.Array, *, mask_id: int, first_ordinary: int, num_ordinary: int,
              mask_prob: float = MASK_PROB) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """BERT's masking: P = round(mask_prob * S) positions per sequence, drawn uniformly among its
  ordinary tokens (ids in [first_ordinary, first_ordinary + num_ordinary); never padding or
  separators). A chosen token becomes mask_id with probability 0.8, a uniformly random ordinary
  token with 0.1, and stays itself with 0.1.

  Returns inputs [B, S], positions [B, P] int32 (the chosen positions), targets [B, P] (the original
  tokens there) and weights [B, P] fp32 (0 where a sequence has fewer than P ordinary tokens).
  """
  select_key, action_key, random_key = jax.random.split(key, 3)
  b, s = tokens_BxS.shape
  predictions = num_predictions(s, mask_prob)
  ordinary_BxS = (tokens_BxS >= first_ordinary) & (tokens_BxS < first_ordinary + num_ordinary)
  scores_BxS = jnp.where(ordinary_BxS, jax.random.uniform(select_key, (b, s)), -1.0)
  scores_BxP, positions_BxP = jax.lax.top_k(scores_BxS, predictions)
  weights_BxP = (scores_BxP >= 0).astype(jnp.float32)
  targets_BxP = jnp.take_along_axis(tokens_BxS, positions_BxP, axis=1)
  action_BxP = jax.random.uniform(action_key, (b, predictions))
  random_BxP = jax.random.randint(random_key, (b, predictions), first_ordinary,
                                  first_ordinary + num_ordinary, tokens_BxS.dtype)
  replaced_BxP = jnp.where(action_BxP < 0.8, mask_id, jnp.where(action_BxP < 0.9, random_BxP, targets_BxP))
  replaced_BxP = jnp.where(weights_BxP > 0, replaced_BxP, targets_BxP)
  rows_Bx1 = jnp.arange(b)[:, None]
  inputs_BxS = tokens_BxS.at[rows_Bx1, positions_BxP].set(replaced_BxP.astype(tokens_BxS.dtype))
  return inputs_BxS, positions_BxP.astype(jnp.int32), targets_BxP, weights_BxP


def next_token(tokens_BxS: jax.Array, *, pad_id: int) -> tuple[jax.Array, None, jax.Array, jax.Array]:
  """Causal LM: inputs are the tokens and every position predicts the next token (the last has no
  target). Returns inputs [B, S], positions None (= all), targets [B, S] and weights [B, S]."""
  targets_BxS = jnp.concatenate([tokens_BxS[:, 1:], jnp.full_like(tokens_BxS[:, :1], pad_id)], axis=1)
  weights_BxS = jnp.ones(tokens_BxS.shape, jnp.float32).at[:, -1].set(0.0)
  return tokens_BxS, None, targets_BxS, weights_BxS


def cross_entropy_sums(logits_BxPxV: jax.Array, targets_BxP: jax.Array,
                       weights_BxP: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted cross-entropy, weighted count of correct argmax predictions), both fp32."""
  logits_BxPxV = logits_BxPxV.astype(jnp.float32)
  log_z_BxP = jax.nn.logsumexp(logits_BxPxV, axis=-1)
  target_logit_BxP = jnp.take_along_axis(logits_BxPxV, targets_BxP[..., None], axis=-1)[..., 0]
  loss = jnp.sum((log_z_BxP - target_logit_BxP) * weights_BxP)
  correct = jnp.sum((jnp.argmax(logits_BxPxV, axis=-1) == targets_BxP) * weights_BxP)
  return loss, correct


def multi_token_loss(mtp_logits_KxBxSxV: jax.Array, targets_BxS: jax.Array, weights_BxS: jax.Array) -> jax.Array:
  """DeepSeek-V3's MTP loss (Sec. 2.2, Eq. 24-25 without lambda): the mean over the K modules of each one's weighted
  mean cross-entropy, module k (0-based) at position i predicting token i + k + 2, i.e. the next-token targets
  shifted left by k + 1 (the positions without such a token weigh 0)."""
  losses = []
  for k in range(mtp_logits_KxBxSxV.shape[0]):
    targets = jnp.roll(targets_BxS, -(k + 1), axis=1)
    weights = jnp.roll(weights_BxS, -(k + 1), axis=1).at[:, targets_BxS.shape[1] - k - 1:].set(0.0)
    loss_sum, _ = cross_entropy_sums(mtp_logits_KxBxSxV[k], targets, weights)
    losses.append(loss_sum / jnp.maximum(jnp.sum(weights), 1.0))
  return jnp.mean(jnp.stack(losses))
