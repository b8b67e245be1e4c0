"""The train state's layout (`moejax.train.trainer.Trainer`'s state): where each part lives, its abstract shape, and
the state completed from fresh parameters. The parts: 'params', 'opt_state', 'step' (int32), 'rng' (uint32 key data),
and where the MoE layers keep them 'slot_tables' [M, A, Z] int32 and 'expert_bias' [M, E] float32; with
train.loss_spike_factor > 0 'loss_window' [W] float32, the last applied steps' losses (`moejax.train.guard`)."""

import jax
import jax.numpy as jnp
import optax

from moejax.models import state as state_lib
from moejax.train import guard

NOT_OPTIMISED = ("slot_tables", "expert_bias")  # replicated, checkpointed, written by the step, no gradient


def shardings(tx, model_cfg, abstract_params, abstract_rest, replicated, pipeline=None, window=False) -> dict:
  """Where each part of the state lives: the params as `state_lib.abstract_state` (or the pipeline's stages) places
  them, every params-like tree of the optimizer state (moments, the master copy) like the params, the rest
  `replicated`. window: the state has a loss-spike window."""
  param_shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
  if pipeline is not None:
    param_shardings = pipeline.shardings(param_shardings)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  masked = lambda x: isinstance(x, optax.MaskedNode)  # Muon's masked trees keep their MaskedNode stand-ins
  opt_shardings = optax.tree_map_params(
    tx,
    lambda x, s: x if masked(x) else s,
    abstract_opt,
    param_shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=masked,
  )
  out = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated, "rng": replicated}
  if window:
    out["loss_window"] = replicated
  for name, stacked in _not_optimised(model_cfg, abstract_rest).items():
    if stacked is not None:
      out[name] = replicated
  return out


def completion(tx, seed: int, state_shardings: dict):
  """The jitted fresh state of fresh params: the optimizer's state, step 0, the step's rng (key seed + 1) and, where
  `state_shardings` has one, an empty loss-spike window."""

  def complete(params):
    state = {
      "params": params,
      "opt_state": tx.init(params),
      "step": jnp.zeros((), jnp.int32),
      "rng": jax.random.key_data(jax.random.key(seed + 1)),
    }
    if "loss_window" in state_shardings:
      state["loss_window"] = guard.empty_window()
    return state

  return jax.jit(complete, out_shardings={k: v for k, v in state_shardings.items() if k not in NOT_OPTIMISED})


def abstract(complete, model_cfg, abstract_params, abstract_rest, state_shardings: dict) -> dict:
  """The state's ShapeDtypeStructs, each with its sharding (what a checkpoint is restored into)."""
  state = jax.eval_shape(complete, abstract_params)
  for name, stacked in _not_optimised(model_cfg, abstract_rest).items():
    if stacked is not None:
      state[name] = stacked
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, state_shardings)


def _not_optimised(model_cfg, rest) -> dict:
  """The MoE layers' slot tables [M, A, Z] and balancing biases [M, E] in `rest`, stacked (None where absent)."""
  return {
    "slot_tables": state_lib.slot_tables(model_cfg, rest),
    "expert_bias": state_lib.expert_biases(model_cfg, rest),
  }
