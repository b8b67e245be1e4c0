"""Mixed-precision training state (DeepSeek-V3's recipe, its report Sec. 3.3): an fp32 master copy of the
parameters kept in the optimizer state beside the bf16 parameters the model computes with, moments in a chosen
dtype, and gradients accumulated in fp32 and handed to the optimizer in the dtype of what it updates.

Without a master copy, an update smaller than half the spacing of bf16 values around a parameter (2^-9 to 2^-8 of
its magnitude) rounds away; the master copy accumulates it in fp32, and the parameters are the master rounded to
their dtype.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterState(NamedTuple):
  """`with_master`'s state: the master copy (a tree like the params, in the master dtype, sharded like them) and the
  wrapped optimizer's state."""

  master: optax.Params
  inner: optax.OptState


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def moments_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`tx` with every state tree it makes from the params (Adam's m and v, Muon's momentum) in `dtype`: its init sees
  the params in `dtype`; each update is computed in the gradients' dtype and its state stored back in the dtypes it
  had (optax before 0.2.5 let v take the gradients' dtype)."""

  def update(grads, state, params=None):
    updates, new_state = tx.update(grads, state, params)
    return updates, jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)

  return optax.GradientTransformation(lambda params: tx.init(_cast(params, dtype)), update)


def with_master(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`tx` applied to a master copy of the params in `dtype`, held in the state (`MasterState`): the master takes
  the updates of `tx` in `dtype`; the params are the master rounded to their own dtype (`apply`). The updates it
  returns are those the master took."""

  def init(params):
    master = _cast(params, dtype)
    return MasterState(master, tx.init(master))

  def update(grads, state, params=None):
    del params  # the master stands in for them
    updates, inner = tx.update(_cast(grads, dtype), state.inner, state.master)
    return updates, MasterState(optax.apply_updates(state.master, updates), inner)

  return optax.GradientTransformation(init, update)


def zeros_for_accumulation(params):
  """Gradient accumulators: float32 zeros like the params (whatever their dtype), so micro-batches add up in fp32."""
  return jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)


def accumulate(total, grads):
  """total + grads in total's dtype (float32)."""
  return jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)


def apply(tx: optax.GradientTransformation, grads, opt_state, params):
  """One optimizer update -> (new params, new opt_state). With a master copy (`with_master` outermost), the new
  params are the new master cast to each parameter's dtype; else the gradients are cast to each parameter's dtype
  (float32 accumulated ones included) and the updates added to the params in that dtype, as optax does."""
  if isinstance(opt_state, MasterState):
    _, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params), opt_state
  updates, opt_state = tx.update(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), opt_state, params)
  return optax.apply_updates(params, updates), opt_state
