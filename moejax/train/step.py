"""The train step's parts (`moejax.train.trainer.Trainer.step` assembles them): each micro-batch's loss and gradients,
accumulated in float32 over the step's micro-batches, the step's metrics, and auxiliary-loss-free balancing's bias
update.

Shapes: U micro-batches of B rows of S tokens, P predicted positions per row (S for the causal LM), M MoE layers of E
experts.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.models import state as state_lib
from moejax.train import precision


def micro_batch_loss(trainer, rest, total: jax.Array, num_micro: int):
  """loss_fn(params, earlier_counts, inputs [B, S], positions [B, P], targets [B, P], weights [B, P], key) ->
  (the micro-batch's share of the step's loss, (loss sum, correct count, aux)): the task loss over the step's `total`
  weight, the auxiliary losses (and MTP's) over the micro-batches. earlier_counts: the choice counts of the step's
  earlier micro-batches (balance_loss='global_batch'), or None."""
  model_cfg = trainer.model_cfg

  def loss_fn(params, earlier_counts, inputs_BxS, positions_BxP, targets_BxP, weights_BxP, key):
    micro_rest = rest
    if earlier_counts is not None:
      micro_rest = state_lib.with_balance_counts(model_cfg, rest, earlier_counts)
    model = nnx.merge(trainer.graphdef, params, micro_rest)
    dropout_key, jitter_key = jax.random.split(key)
    # The output layer and the cross-entropy in vocabulary chunks: no [B, P, V] logits (`moejax.models.lm_loss`).
    loss_sum, correct, aux = trainer.model_loss_sums(
      model,
      inputs_BxS,
      positions_BxP,
      targets_BxP,
      weights_BxP,
      chunk=trainer.loss_chunk,
      rngs=nnx.Rngs(dropout=dropout_key, jitter=jitter_key),
    )
    loss = loss_sum / total + aux["aux_loss"] / num_micro
    if "mtp_loss" in aux:  # DeepSeek-V3's multi-token prediction: lambda x the modules' mean loss (Eq. 25)
      aux["mtp_loss"] /= num_micro
      loss += model_cfg.mtp_loss_coef * aux["mtp_loss"] + aux["mtp_aux_loss"] / num_micro
    return loss, (loss_sum, correct, aux)

  return loss_fn


def accumulated(loss_fn, params, counts, micro_batches):
  """(grads float32, loss sums [U], correct counts [U], auxes stacked [U, ...]) of `loss_fn` over the micro-batches
  (inputs, positions, targets, weights, keys; each [U, ...]), one after another. counts: the layers' balance counts
  (balance_loss='global_batch': each micro-batch's loss sees the choice counts of the step's earlier ones), or None."""

  def micro_step(carry, micro):
    grads, earlier_counts = carry
    (_, (loss_sum, correct, aux)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, earlier_counts, *micro)
    earlier_counts = aux.pop("balance_counts", None)  # the layers return theirs plus the earlier: the next's input
    return (precision.accumulate(grads, g), earlier_counts), (loss_sum, correct, aux)

  zeros = precision.zeros_for_accumulation(params)  # float32 whatever the parameters' dtype
  (grads, _), (loss_sums, corrects, auxes) = jax.lax.scan(
    micro_step, (zeros, None if counts is None else jnp.zeros_like(counts)), micro_batches
  )
  return grads, loss_sums, corrects, auxes


def metrics(grads, loss_sums, corrects, auxes, total: jax.Array, learning_rate, model_cfg) -> dict:
  """The step's metrics: loss (task + aux (+ MTP)), task_loss, accuracy, aux_loss, grad_norm, learning_rate and the
  whole step's loads expert_counts [M, E], tokens_dropped and tokens_overflowed (summed over the micro-batches);
  with MTP modules mtp_loss, added to the loss times model_cfg.mtp_loss_coef."""
  task_loss, aux_loss = jnp.sum(loss_sums) / total, jnp.mean(auxes["aux_loss"])
  out = {
    "loss": task_loss + aux_loss,
    "task_loss": task_loss,
    "accuracy": jnp.sum(corrects) / total,
    "aux_loss": aux_loss,
    "grad_norm": optax.tree.norm(grads),
    "learning_rate": learning_rate,
    "expert_counts": jnp.sum(auxes["expert_counts"], axis=0),
    "tokens_dropped": jnp.sum(auxes["tokens_dropped"], axis=0),
    "tokens_overflowed": jnp.sum(auxes["tokens_overflowed"], axis=0),
  }
  if "mtp_loss" in auxes:
    out["mtp_loss"] = jnp.sum(auxes["mtp_loss"])
    out["loss"] += model_cfg.mtp_loss_coef * out["mtp_loss"]
  return out


def update_expert_bias(bias_MxE: jax.Array, counts_MxE: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free balancing update (Sec. 2.1.2), per MoE layer: b_e += u * sign(mean
  load - load_e), from one step's token-choices per expert counts [M, E]; an overloaded expert's bias
  falls, an underloaded one's rises, one equal to the mean keeps its bias. float32 like the bias."""
  load_MxE = counts_MxE.astype(jnp.float32)
  mean_Mx1 = jnp.mean(load_MxE, axis=-1, keepdims=True)
  step_MxE = jnp.sign(mean_Mx1 - load_MxE)
  # zero experts' columns of a bias [M, E + Z] (rate 0 with them: the bias is frozen) move by nothing
  step_MxE = jnp.pad(step_MxE, ((0, 0), (0, bias_MxE.shape[-1] - step_MxE.shape[-1])))
  return bias_MxE + jnp.float32(rate) * step_MxE
