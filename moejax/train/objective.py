"""What the models learn to predict: BERT masking for the MLM, next tokens for the causal LM.

Both objectives turn a batch of token ids into inputs, the positions to predict, their targets and
weights; the model computes logits only at those positions (for the MLM, the masked ones: 15% of
the vocabulary projection's cost), and the loss is the weighted mean cross-entropy
(`moejax.models.lm_loss`). Randomness comes from one key per step, so masks are identical however the batch is
sharded or split across processes.
"""

import dataclasses

import jax
import jax.numpy as jnp

# The loss moved to moejax.models.lm_loss (below moejax.pipeline, which needs it); these two names stay importable
# from here for configs/memory.py and experiments/{memory,convergence}.py until they import moejax.models.lm_loss.
from moejax.models import lm_loss
from moejax.models.lm_loss import LOSS_CHUNK, cross_entropy_sums  # noqa: F401


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


def bert_mask(
  key: jax.Array,
  tokens_BxS: jax.Array,
  *,
  mask_id: int,
  first_ordinary: int,
  num_ordinary: int,
  mask_prob: float = MASK_PROB,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
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
  random_BxP = jax.random.randint(
    random_key, (b, predictions), first_ordinary, first_ordinary + num_ordinary, tokens_BxS.dtype
  )
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


def model_loss_sums(
  model,
  inputs_BxS: jax.Array,
  positions_BxP: jax.Array | None,
  targets_BxP: jax.Array,
  weights_BxP: jax.Array,
  *,
  chunk: int,
  rngs,
) -> tuple[jax.Array, jax.Array, dict]:
  """A training forward of `model` (a `LanguageModel` or `Decoder`) and its loss, the output layer computed
  `chunk` vocabulary columns at a time (`lm_loss.head_cross_entropy_sums`): (weighted cross-entropy sum, weighted
  count of correct argmax predictions, the model's aux), and with MTP modules aux['mtp_loss'], their mean loss
  (`lm_loss.mean_over_modules`), in place of the modules' inputs aux['mtp_features']. The train step's loss
  (`moejax/train/trainer.py`)."""
  h_BxPxD, aux = model(inputs_BxS, positions_BxP=positions_BxP, train=True, rngs=rngs, features=True)
  kernel_DxV, bias_V = model.output_layer()
  loss_sum, correct = lm_loss.head_cross_entropy_sums(h_BxPxD, kernel_DxV, bias_V, targets_BxP, weights_BxP, chunk)
  if "mtp_features" in aux:
    h_KxBxSxD = aux.pop("mtp_features")
    aux["mtp_loss"] = lm_loss.mean_over_modules(
      lambda k, t, w: lm_loss.head_cross_entropy_sums(h_KxBxSxD[k], kernel_DxV, bias_V, t, w, chunk)[0],
      h_KxBxSxD.shape[0],
      targets_BxP,
      weights_BxP,
    )
  return loss_sum, correct, aux
