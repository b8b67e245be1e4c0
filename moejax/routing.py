"""Routers: from token activations to a RoutingDecision, plus the auxiliary losses.

All functions here work on the tokens they are given (one device's share inside `shard_map`); the
layer sums the loss statistics over the mesh so that the losses are those of the global batch.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig


class RoutingDecision(NamedTuple):
  """expert_ids: [T, k] int32 chosen experts (descending probability); weights: [T, k] fp32 combine
  weights; probs: [T, E] fp32 router probabilities; logits: [T, E] fp32."""

  expert_ids: jax.Array
  weights: jax.Array
  probs: jax.Array
  logits: jax.Array


def route_topk(x_TxD: jax.Array, kernel_DxE: jax.Array, cfg: MoEConfig) -> RoutingDecision:
  """Softmax top-k router (Switch k=1, GShard k=2); ties go to the lower expert id."""
  logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), kernel_DxE.astype(jnp.float32))
  probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  weights_TxK, ids_TxK = jax.lax.top_k(probs_TxE, cfg.top_k)
  if cfg.renormalize:
    weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
  return RoutingDecision(ids_TxK.astype(jnp.int32), weights_TxK, probs_TxE, logits_TxE)


def expert_capacity(cfg: MoEConfig, local_tokens: int) -> int:
  """Token-choices one device may send to one expert: ceil(capacity_factor * tokens * k / E)."""
  return math.ceil(cfg.capacity_factor * local_tokens * cfg.top_k / cfg.num_experts)


def queue_positions(ids_TxK: jax.Array, num_experts: int) -> jax.Array:
  """[T, k] position of each token-choice in its expert's queue.

  Priority: every first choice before any second choice, and so on; within a choice rank, earlier
  tokens first (GShard). A choice is kept under capacity C iff its position is < C.
  """
  tokens, k = ids_TxK.shape
  ids_choice_major = ids_TxK.T.reshape(-1)  # [k*T], rank 0 of every token first
  onehot = jax.nn.one_hot(ids_choice_major, num_experts, dtype=jnp.int32)
  positions = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, ids_choice_major[:, None], axis=1)
  return positions.reshape(k, tokens).T


class LossStats(NamedTuple):
  """Per-device sums that become the global auxiliary losses once summed over the mesh.

  choice_counts: [E] token-choices routed to each expert (before any drop); prob_sums: [E] sum over
  tokens of the router probabilities; z_sum: scalar sum over tokens of logsumexp(logits)^2;
  tokens: scalar token count."""

  choice_counts: jax.Array
  prob_sums: jax.Array
  z_sum: jax.Array
  tokens: jax.Array


def loss_stats(decision: RoutingDecision, num_experts: int) -> LossStats:
  counts = jnp.zeros(num_experts, jnp.float32).at[decision.expert_ids.reshape(-1)].add(1.0)
  z = jax.nn.logsumexp(decision.logits, axis=-1)
  return LossStats(counts, jnp.sum(decision.probs, axis=0), jnp.sum(z * z),
                   jnp.asarray(decision.probs.shape[0], jnp.float32))


def aux_losses(stats: LossStats, cfg: MoEConfig) -> dict[str, jax.Array]:
  """Switch load-balance loss alpha * E * sum_e f_e * P_e and the router z-loss, from global stats."""
  f_E = stats.choice_counts / (stats.tokens * cfg.top_k)
  p_E = stats.prob_sums / stats.tokens
  load_balance = cfg.load_balance_coef * cfg.num_experts * jnp.sum(f_E * p_E)
  z_loss = cfg.z_loss_coef * stats.z_sum / stats.tokens
  return {"load_balance_loss": load_balance, "z_loss": z_loss, "aux_loss": load_balance + z_loss}
