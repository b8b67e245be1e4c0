"""Routers: from token activations to a RoutingDecision, plus the statistics of the auxiliary losses.

`route` works on the tokens it is given (one device's share inside `shard_map`) and returns, next
to the decision, per-device sums; the layer sums them over the mesh, so `aux_losses` gives the losses
of the global batch. Routers are replicated (tied across devices): a token's route does not depend
on the device that holds it.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import plan as plan_lib
from moejax.moe.config import MoEConfig


class RoutingDecision(NamedTuple):
  """expert_ids: [T, K] int32 global expert of each choice (index = priority rank);
  weights: [T, K] fp32 combine weights."""

  expert_ids: jax.Array
  weights: jax.Array


def router_names(cfg: MoEConfig) -> tuple[str, ...]:
  """The router parameters of a routing, each {'kernel': [d, width]}."""
  return ("node_router", "local_router") if cfg.routing == "bilevel" else ("router",)


def router_widths(cfg: MoEConfig) -> dict[str, int]:
  if cfg.routing == "bilevel":
    return {"node_router": cfg.num_nodes, "local_router": cfg.experts_per_node}
  return {"router": cfg.num_experts}


def _softmax_router(x_TxD, params, name):
  logits = jnp.dot(x_TxD.astype(jnp.float32), params[name]["kernel"].astype(jnp.float32))
  return logits, jax.nn.softmax(logits, axis=-1)


def _counts(ids, size):
  return plan_lib.histogram(ids, size).astype(jnp.float32)


def _z_sum(logits):
  z = jax.nn.logsumexp(logits, axis=-1)
  return jnp.sum(z * z)


def _renormalize(weights_TxK, cfg):
  return weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True) if cfg.renormalize else weights_TxK


def route(x_TxD: jax.Array, params: dict, cfg: MoEConfig, bias_E: jax.Array | None = None,
          sequence_length: int | None = None) -> tuple[RoutingDecision, dict]:
  """x [T, d] -> (decision, loss statistics: sums over these T tokens, to be summed over devices).

  bias_E: the auxiliary-loss-free balancing bias [E], added to the scores that choose the experts only.
  sequence_length: with balance_loss='sequence', the tokens of one sequence (T holds whole sequences).
  """
  tokens = jnp.asarray(x_TxD.shape[0], jnp.float32)
  if cfg.routing == "bilevel":
    return _route_bilevel(x_TxD, params, cfg, tokens)
  logits = jnp.dot(x_TxD.astype(jnp.float32), params["router"]["kernel"].astype(jnp.float32))
  if cfg.score == "softmax":
    scores_TxE = probs_TxE = jax.nn.softmax(logits, axis=-1)
  else:  # DeepSeek-V3: sigmoid affinities; the balance loss takes them normalised over the experts (Eq. 19)
    scores_TxE = jax.nn.sigmoid(logits)
    probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
  select_TxE = scores_TxE if bias_E is None else scores_TxE + bias_E
  if cfg.group_limit is not None:
    select_TxE = _limit_to_groups(select_TxE, *cfg.group_limit, cfg.group_score if cfg.routing == "topk" else "top2_sum")
  _, ids = jax.lax.top_k(select_TxE, cfg.top_k)
  weights = jnp.take_along_axis(scores_TxE, ids, axis=1)
  weights = _renormalize(weights, cfg) * cfg.routed_scaling  # V3 Eq. 13 with renormalize
  stats = {"choice_counts": _counts(ids, cfg.num_experts), "prob_sums": jnp.sum(probs_TxE, axis=0),
           "z_sum": _z_sum(logits), "tokens": tokens}
  if cfg.balance_loss == "sequence":
    stats["sequence_loss_sum"], stats["sequences"] = _sequence_loss_sum(ids, probs_TxE, sequence_length, cfg)
  return RoutingDecision(ids.astype(jnp.int32), weights), stats


def _limit_to_groups(select_TxE, groups: int, kept: int, group_score: str = "top2_sum"):
  """Group-limited routing (DeepSeek-V2/V3): groups of E / groups contiguous experts, each scored by the sum
  of its two best selection scores ('top2_sum', V3) or its best ('max', V2); experts outside a token's `kept`
  best groups are masked out."""
  tokens, num_experts = select_TxE.shape
  per_group = num_experts // groups
  best = 1 if group_score == "max" else min(2, per_group)
  group_scores = jnp.sum(jax.lax.top_k(select_TxE.reshape(tokens, groups, per_group), best)[0], -1)
  _, best_groups = jax.lax.top_k(group_scores, kept)
  allowed_groups = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best_groups].set(True)
  return jnp.where(jnp.repeat(allowed_groups, per_group, axis=1), select_TxE, -jnp.inf)


def _sequence_loss_sum(ids_TxK, probs_TxE, sequence_length: int, cfg: MoEConfig):
  """(sum over these tokens' sequences of sum_e f_e P_e, the number of sequences): DeepSeek-V3 Eqs. 17-20
  without alpha, f_e = E / (K L) x the sequence's choices of e, P_e = its mean normalised score."""
  sequences = ids_TxK.shape[0] // sequence_length
  counts_BxE = jax.vmap(lambda ids: _counts(ids, cfg.num_experts))(ids_TxK.reshape(sequences, -1))
  f_BxE = counts_BxE * cfg.num_experts / (cfg.top_k * sequence_length)
  p_BxE = probs_TxE.reshape(sequences, sequence_length, -1).mean(axis=1)
  return jnp.sum(f_BxE * p_BxE), jnp.asarray(sequences, jnp.float32)


def _route_bilevel(x_TxD, params, cfg, tokens):
  """SMILE (Eq. 3): token -> top nodes i by p, then top local experts j by q; weight p_i * q_j."""
  node_logits, p_TxN = _softmax_router(x_TxD, params, "node_router")
  local_logits, q_TxL = _softmax_router(x_TxD, params, "local_router")
  p_top, nodes = jax.lax.top_k(p_TxN, cfg.node_top_k)
  q_top, local = jax.lax.top_k(q_TxL, cfg.top_k)
  # Choice (a, b) = a-th node, b-th local expert, at rank a * top_k + b.
  ids = (nodes[:, :, None] * cfg.experts_per_node + local[:, None, :]).reshape(x_TxD.shape[0], -1)
  weights = (p_top[:, :, None] * q_top[:, None, :]).reshape(x_TxD.shape[0], -1)
  stats = {"node_counts": _counts(nodes, cfg.num_nodes), "node_prob_sums": jnp.sum(p_TxN, axis=0),
           "local_counts": _counts(local, cfg.experts_per_node), "local_prob_sums": jnp.sum(q_TxL, axis=0),
           "z_sum": _z_sum(node_logits) + _z_sum(local_logits), "tokens": tokens}
  return RoutingDecision(ids.astype(jnp.int32), _renormalize(weights, cfg)), stats


def _balance_terms(cfg: MoEConfig):
  """(choice counts, probability sums, coefficient, choices per token) of each balanced router."""
  if cfg.routing == "bilevel":
    return [("node_counts", "node_prob_sums", cfg.alpha, cfg.node_top_k),
            ("local_counts", "local_prob_sums", cfg.beta, cfg.top_k)]
  return [("choice_counts", "prob_sums", cfg.alpha, cfg.top_k)]


def balance_counts(stats: dict, cfg: MoEConfig) -> jax.Array:
  """[cfg.balance_counts_size] float32: the routers' choice counts in `stats`, concatenated."""
  return jnp.concatenate([stats[counts] for counts, *_ in _balance_terms(cfg)])


def aux_losses(stats: dict, cfg: MoEConfig, prior_counts: jax.Array | None = None) -> dict[str, jax.Array]:
  """Load-balance loss and router z-loss from global statistics.

  topk / node_limited: Switch's alpha * E * sum_e f_e P_e (f: fraction of token-choices sent to e,
  P: mean router probability; with sigmoid scores, the scores normalised over the experts), over all
  tokens ('batch') or per sequence and averaged ('sequence', DeepSeek-V3 Eqs. 17-20). bilevel: SMILE's
  Eq. 4, alpha * n * sum_i f_i P_i + beta * m' * sum_j f_j Q_j over nodes i and local experts j (minimum
  alpha + beta under uniform routing). prior_counts ('global_batch'): earlier micro-batches' choice counts
  (`balance_counts`), added to these tokens' in f; P stays these tokens'.
  z-loss: z_loss_coef * mean over tokens of logsumexp(logits)^2 (summed over both routers).
  """
  tokens = stats["tokens"]
  if cfg.balance_loss == "sequence":
    load_balance = cfg.alpha * stats["sequence_loss_sum"] / stats["sequences"]
  else:
    load_balance, start = jnp.zeros((), jnp.float32), 0
    for counts_key, probs_key, coef, choices in _balance_terms(cfg):
      counts = stats[counts_key]
      f = counts / (tokens * choices)
      if prior_counts is not None:
        prior = prior_counts[start:start + counts.shape[0]]
        f = (counts + prior) / (tokens * choices + jnp.sum(prior))
      start += counts.shape[0]
      load_balance = load_balance + coef * counts.shape[0] * jnp.sum(f * stats[probs_key] / tokens)
  z_loss = cfg.z_loss_coef * stats["z_sum"] / tokens
  return {"load_balance_loss": load_balance, "z_loss": z_loss, "aux_loss": load_balance + z_loss}


def expert_capacity(cfg: MoEConfig, local_tokens: int) -> int:
  """Token-choices one device may send to one expert: ceil(capacity_factor * tokens * K / E)."""
  return math.ceil(cfg.capacity_factor * local_tokens * cfg.choices_per_token / cfg.num_experts)


def queue_positions(ids_TxK: jax.Array, num_experts: int) -> jax.Array:
  """[T, K] position of each token-choice in its expert's queue.

  Priority: every first choice before any second choice, and so on; within a choice rank, earlier
  tokens first (GShard). A choice is kept under capacity C iff its position is < C. One stable sort of
  the T K choices: O(T K log(T K)) time and O(T K + E) memory, whatever the number of experts.
  """
  tokens, k = ids_TxK.shape
  ids_R = ids_TxK.T.reshape(-1)  # choice-major: rank 0 of every token first
  return plan_lib.rank_in_group(ids_R, num_experts).reshape(k, tokens).T
