"""Zero-computation experts (LongCat-Flash, `MoEConfig.zero_experts`): Z experts after the E real ones, ids E ..
E + Z - 1, whose output is the token itself (times the choice's weight), with no parameters.

The router scores all E + Z (its kernel is [d, E + Z]); a choice of a zero expert is combined on the token's own
device and never enters an exchange: the layer sends only the real choices (`real`), so such a choice puts no row
in any hop's send buffer and no count in `traffic_rows` / `traffic_bytes`, and a token whose every choice is a zero
expert moves nothing at all. Capacity never drops a zero expert's choice (it holds no queue), and the zero experts'
choices are counted apart from the real experts' (`counts`, aux['zero_expert_counts'] [Z]). This module is the one
home of those rules in the layer; `moe.reference` writes the same semantics plainly.
"""

import jax
import jax.numpy as jnp

from moejax.moe import plan as plan_lib
from moejax.validation import is_int, require

# Why the trainer's update rule of the balancing bias does not meet zero experts (`check`).
BIAS_REFUSAL = (
  "0 with zero_experts (the trainer's update b += u * sign(mean load - load) drives every expert to the mean load, "
  "while LongCat-Flash steers the zero experts' share to a compute budget: a target of its own, not the mean; a bias "
  "you update yourself passes as moe_apply(..., expert_bias=[E + Z]))"
)


def check(cfg, router) -> None:
  """Raises ConfigError naming the field unless zero_experts is an int >= 0 that the routing and the rest take."""
  require(is_int(cfg.zero_experts, 0), "zero_experts", cfg.zero_experts, "an int >= 0")
  if cfg.zero_experts:
    require(
      router.zero_refusal is None,
      "zero_experts",
      cfg.zero_experts,
      f"0 with routing={cfg.routing!r} ({router.zero_refusal})",
    )
    require(cfg.bias_update_rate == 0, "bias_update_rate", cfg.bias_update_rate, BIAS_REFUSAL)


def real(ids_TxK: jax.Array, num_experts: int) -> jax.Array:
  """[T, K] bool: the choices of real experts (ids < E), the only ones that cross the wire."""
  return ids_TxK < num_experts


def identity_sum(x_TxD: jax.Array, ids_TxK: jax.Array, w_TxK: jax.Array, num_experts: int) -> jax.Array:
  """[T, d] float32: each token's zero-expert choices, the token itself times their weights, summed (computed where
  the token is: its own device)."""
  w_T = jnp.sum(jnp.where(real(ids_TxK, num_experts), jnp.zeros((), w_TxK.dtype), w_TxK), axis=1)
  return w_T[:, None].astype(jnp.float32) * x_TxD.astype(jnp.float32)


def counts(ids_TxK: jax.Array, num_experts: int, zero_experts: int) -> jax.Array:
  """[Z] int32: the choices of each zero expert (real ids fall outside and count nowhere)."""
  return plan_lib.histogram(jnp.where(real(ids_TxK, num_experts), -1, ids_TxK - num_experts), zero_experts)
