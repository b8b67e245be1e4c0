"""The flat router's scores (`MoEConfig.score`), one function each: logits [T, E] float32 -> (the scores that
select and weight the experts, the probabilities the balance loss takes), both [T, E].

  softmax       Switch, GShard, Mixtral, Qwen: a distribution over the experts, the loss's probabilities themselves
  sigmoid       DeepSeek-V3 (Sec. 2.1.2): an independent affinity per expert
  sqrtsoftplus  DeepSeek-V4: sqrt(softplus(logit)), an independent affinity per expert growing like sqrt(logit)

Independent affinities are normalised over the experts for the loss (DeepSeek-V3 Eq. 19)."""

import jax
import jax.numpy as jnp


def _softmax(logits_TxE):
  probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  return probs_TxE, probs_TxE


def _independent(affinity):
  def scores(logits_TxE):
    s_TxE = affinity(logits_TxE)
    return s_TxE, s_TxE / jnp.sum(s_TxE, axis=-1, keepdims=True)

  return scores


SCORES = {
  "softmax": _softmax,
  "sigmoid": _independent(jax.nn.sigmoid),
  "sqrtsoftplus": _independent(lambda logits: jnp.sqrt(jax.nn.softplus(logits))),
}
SOFTMAX = "softmax"  # a distribution already: bilevel routing multiplies two of them
