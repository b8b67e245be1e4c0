"""Held-out evaluation during training: the loss on held-out documents (`moejax.data.sources`: every
data.heldout_every-th document of each file, never trained on) after every log.eval_every-th step and the last.

The evaluation is part of the jitted train step (`Trainer(heldout=...)`), run under `jax.lax.cond` only on the
steps it is due, on the parameters (and balancing biases, slot tables) the step has just produced: no host
round-trip, no second program. Its batches are log.eval_batches micro-batches of the training's rows and sequence
length, the same ones every time (the MLM's masks drawn from a fixed key per batch), so the curve is comparable from
step to step; the loss is the task's cross-entropy per prediction, without auxiliary or MTP losses, in eval mode
(no dropout). Steps without evaluation report NaN, which `moejax.train.metrics.step_record` leaves out.
"""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.data import pipeline as pipeline_lib
from moejax.models import lm_loss
from moejax.train import metrics as metrics_lib
from moejax.validation import ConfigError, require

KEY = 1234  # the MLM masks' key: batch i is masked with fold_in(key(KEY), i)


def check(config) -> None:
  """Refuses log.eval_every > 0 with nothing held out (data.heldout_every 0)."""
  require(
    config.log.eval_every == 0 or config.data.heldout_every > 0,
    "log.eval_every",
    config.log.eval_every,
    "0 while data.heldout_every is 0 (nothing is held out to evaluate on)",
  )


def batches(config, files: list[str], tok) -> tuple[np.ndarray, float]:
  """(held-out tokens [log.eval_batches, B, seq_len] of the micro-batches' B rows, the unigram entropy of their
  ordinary tokens: the loss of predicting each by its frequency alone); ConfigError when the split holds fewer."""
  rows = config.batch_size // config.micro_batches
  try:
    tokens = pipeline_lib.heldout_tokens(
      files, tok, config.data.heldout_every, config.log.eval_batches, rows, config.seq_len
    )
  except ValueError as e:
    raise ConfigError(
      f"{e}: lower log.eval_batches or data.heldout_every", "log.eval_batches", config.log.eval_batches
    ) from e
  counts = np.bincount(tokens.ravel(), minlength=tok.num_ids)[
    tok.first_ordinary : tok.first_ordinary + tok.num_ordinary
  ]
  return tokens, metrics_lib.unigram_entropy(counts)


def due(step: jax.Array, every: int, last: int) -> jax.Array:
  """Whether step `step` (after the update, 1-based) is evaluated: every `every`-th and the last."""
  return (step % every == 0) | (step == last)


def mean_loss(forward, targets, tokens_KxBxS: jax.Array) -> jax.Array:
  """The mean cross-entropy per prediction over the K held-out batches tokens [K, B, S], one batch at a time.

  forward(inputs [B, S], positions [B, P] or None) -> logits [B, P, V]; targets(key, tokens [B, S]) -> (inputs,
  positions, targets, weights), the training objective's."""

  def batch(i, tokens_BxS):
    inputs_BxS, positions_BxP, targets_BxP, weights_BxP = targets(
      jax.random.fold_in(jax.random.key(KEY), i), tokens_BxS
    )
    loss_sum, _ = lm_loss.cross_entropy_sums(forward(inputs_BxS, positions_BxP), targets_BxP, weights_BxP)
    return loss_sum, jnp.sum(weights_BxP)

  sums, weights = jax.lax.map(lambda args: batch(*args), (jnp.arange(tokens_KxBxS.shape[0]), tokens_KxBxS))
  return jnp.sum(sums) / jnp.maximum(jnp.sum(weights), 1.0)
