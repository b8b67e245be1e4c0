"""The optimizer of SMILE's experiments: LAMB after global-norm clipping, with warm-up and decay.

LAMB is assembled from optax's pieces as in `optax.lamb` (Adam moments, decoupled weight decay,
layer-wise trust ratio, learning rate), except that the trust ratio of an expert tensor [E, ...] is
taken per expert: each expert is its own parameter, as in implementations that keep one weight per
expert, so one expert's norm never scales another's update.
"""

import jax
import jax.numpy as jnp
import optax

from moejax.validation import is_int, is_number, require

DECAYS = ("linear", "cosine")
CONFIG_FIELDS = ("learning_rate", "warmup_steps", "decay", "decay_steps", "end_fraction", "b1", "b2", "eps",
                 "weight_decay", "clip_norm")


def validate_config(o, prefix: str = "") -> None:
  """Checks the optim section `o` (fields CONFIG_FIELDS); errors name the field with `prefix`
  (e.g. 'optim.')."""
  require(is_number(o.learning_rate) and o.learning_rate > 0, prefix + "learning_rate", o.learning_rate, "> 0")
  require(is_int(o.warmup_steps, 0), prefix + "warmup_steps", o.warmup_steps, "an int >= 0")
  require(o.decay in DECAYS, prefix + "decay", o.decay, f"one of {DECAYS}")
  require(is_int(o.decay_steps, 0), prefix + "decay_steps", o.decay_steps, "an int >= 0 (0: steps)")
  require(is_number(o.end_fraction) and 0 <= o.end_fraction <= 1, prefix + "end_fraction", o.end_fraction,
          "in [0, 1]")
  for name in ("b1", "b2"):
    require(is_number(o[name]) and 0 <= o[name] < 1, prefix + name, o[name], "in [0, 1)")
  for name in ("eps", "clip_norm"):
    require(is_number(o[name]) and o[name] > 0, prefix + name, o[name], "> 0")
  require(is_number(o.weight_decay) and o.weight_decay >= 0, prefix + "weight_decay", o.weight_decay, ">= 0")


def warmup_then_decay(peak: float, warmup_steps: int, total_steps: int, decay: str = "linear",
                      end_fraction: float = 0.0) -> optax.Schedule:
  """Linear warm-up over `warmup_steps` (the first update already uses peak / warmup_steps), then
  linear or cosine decay to `end_fraction * peak` at `total_steps`."""

  def learning_rate(count):
    warm = jnp.minimum(1.0, (count + 1) / max(warmup_steps, 1))
    progress = jnp.clip((count - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
    if decay == "linear":
      fall = 1.0 - progress
    else:
      fall = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return peak * warm * (end_fraction + (1.0 - end_fraction) * fall)

  return learning_rate


def scale_by_trust_ratio(per_expert) -> optax.GradientTransformation:
  """LAMB's trust ratio |param| / |update|, over each whole tensor, or per slice [i] of the tensors
  marked True in `per_expert` (a tree like the params); 1 where either norm is 0."""

  def update_fn(updates, state, params):
    def scale(u, p, expert):
      axes = tuple(range(1, p.ndim)) if expert else None
      p_norm = jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axis=axes, keepdims=True))
      u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=axes, keepdims=True))
      ratio = jnp.where((p_norm > 0) & (u_norm > 0), p_norm / jnp.where(u_norm > 0, u_norm, 1.0), 1.0)
      return (u * ratio).astype(u.dtype)

    return jax.tree.map(scale, updates, params, per_expert), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lamb(learning_rate: optax.ScalarOrSchedule, per_expert, *, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-6, weight_decay: float = 0.01, clip_norm: float = 1.0) -> optax.GradientTransformation:
  """Clip by global norm, then LAMB. Weight decay skips vectors (biases, LayerNorm), as in BERT."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      scale_by_trust_ratio(per_expert),
      optax.scale_by_learning_rate(learning_rate),
  )
