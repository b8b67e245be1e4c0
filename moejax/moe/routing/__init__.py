"""Routers: from token activations to a RoutingDecision, plus the statistics of the auxiliary losses.

One interface, `Router`, one class per routing (`ROUTERS`: `flat.TopK`, `flat.NodeLimited`, `bilevel.BiLevel`,
`hashed.Hashed`; zero-computation experts for all but bilevel: `zero`),
built once from the config (`of(cfg)`, `MoEConfig.router`). The layer, the reference, placement and the study ask
the router, never the routing's name. A router says, in plain Python: its kernels' widths (`widths`, each
{'kernel': [d, width]}), the (token, expert) choices a token makes, the groups of contiguous experts it routes by
(which a placement must keep whole), what each kernel's columns index; and traced: `route` (one device's tokens,
with per-device loss statistics that the layer sums over the mesh) and `reference` (the same routing on the whole
batch, written plainly: the semantics `moe.reference` and the tests compare against).

Routers are replicated (tied across devices): a token's route does not depend on the device that holds it.
"""

import math

import jax
import jax.numpy as jnp

from moejax.moe import plan as plan_lib
from moejax.moe.routing.base import Blocks, ReferenceRoute, Router, RoutingDecision  # noqa: F401  (the interface)
from moejax.moe.routing.bilevel import BiLevel
from moejax.moe.routing.flat import NodeLimited, TopK
from moejax.moe.routing.hashed import Hashed, hash_experts  # noqa: F401  (the plan before the layer runs)

ROUTERS = {cls.name: cls for cls in (TopK, BiLevel, NodeLimited, Hashed)}


def of(cfg) -> Router:
  """The router of `cfg.routing`."""
  return ROUTERS[cfg.routing](cfg)


def route(
  x_TxD: jax.Array,
  params: dict,
  cfg,
  bias_E: jax.Array | None = None,
  sequence_length: int | None = None,
  token_ids_T: jax.Array | None = None,
  hash_index_S: jax.Array | None = None,
  hash_table_VxK: jax.Array | None = None,
) -> tuple[RoutingDecision, dict]:
  """x [T, d] -> (decision, loss statistics) by the config's router (`Router.route`).

  bias_E: the auxiliary-loss-free balancing bias [E + Z], added to the scores that choose the experts only.
  sequence_length: with balance_loss='sequence', the tokens of one sequence (T holds whole sequences).
  token_ids_T: the tokens' ids [T], which 'hash' routes by; hash_index_S [E + Z]: where each expert the hash names
  sits after a placement (None: where it started); hash_table_VxK [V, K]: each id's experts (None: the hash's).
  """
  return cfg.router.route(x_TxD, params, bias_E, sequence_length, token_ids_T, hash_index_S, hash_table_VxK)


def router_names(cfg) -> tuple[str, ...]:
  """The router parameters of a routing, each {'kernel': [d, width]}."""
  return tuple(cfg.router.widths)


def router_widths(cfg) -> dict[str, int]:
  return cfg.router.widths


def balance_counts(stats: dict, cfg) -> jax.Array:
  """[cfg.balance_counts_size] float32: the routers' choice counts in `stats`, concatenated."""
  return jnp.concatenate([stats["counts"][name] for name, *_ in cfg.router.balance_terms()])


def aux_losses(stats: dict, cfg, prior_counts: jax.Array | None = None) -> dict[str, jax.Array]:
  """Load-balance loss and router z-loss from global statistics (`route`'s, summed over the devices).

  Each balanced router's Switch loss coef * X * sum_x f_x P_x (f: fraction of its choices made for x, P: its mean
  probability of x; with sigmoid scores, the scores normalised over the experts), summed: topk and node_limited,
  alpha * E * sum_e f_e P_e; bilevel, SMILE's Eq. 4, alpha * n * sum_i f_i P_i + beta * m' * sum_j f_j Q_j (minimum
  alpha + beta under uniform routing). 'sequence' (DeepSeek-V3 Eqs. 17-20): per sequence, averaged. prior_counts
  ('global_batch'): earlier micro-batches' choice counts (`balance_counts`), added to these tokens' in f; P stays
  these tokens'. z-loss: z_loss_coef * mean over tokens of logsumexp(logits)^2 (summed over the routers).
  """
  tokens = stats["tokens"]
  if cfg.balance_loss == "sequence":
    load_balance = cfg.alpha * stats["sequence_loss_sum"] / stats["sequences"]
  else:
    load_balance, start = jnp.zeros((), jnp.float32), 0
    for name, coef, choices in cfg.router.balance_terms():
      made = stats["counts"][name]
      f = made / (tokens * choices)
      if prior_counts is not None:
        prior = prior_counts[start : start + made.shape[0]]
        f = (made + prior) / (tokens * choices + jnp.sum(prior))
      start += made.shape[0]
      load_balance = load_balance + coef * made.shape[0] * jnp.sum(f * stats["prob_sums"][name] / tokens)
  z_loss = cfg.z_loss_coef * stats["z_sum"] / tokens
  return {"load_balance_loss": load_balance, "z_loss": z_loss, "aux_loss": load_balance + z_loss}


def expert_capacity(cfg, local_tokens: int) -> int:
  """Token-choices one device may send to one expert: ceil(capacity_factor * tokens * K / E)."""
  return math.ceil(cfg.capacity_factor * local_tokens * cfg.choices_per_token / cfg.num_experts)


def queue_positions(ids_TxK: jax.Array, num_experts: int) -> jax.Array:
  """[T, K] position of each token-choice in its expert's queue (meaningless for ids outside [0, E): zero experts).

  Priority: every first choice before any second choice, and so on; within a choice rank, earlier
  tokens first (GShard). A choice is kept under capacity C iff its position is < C. One stable sort of
  the T K choices: O(T K log(T K)) time and O(T K + E) memory, whatever the number of experts.
  """
  tokens, k = ids_TxK.shape
  ids_R = ids_TxK.T.reshape(-1)  # choice-major: rank 0 of every token first
  ids_R = jnp.where((ids_R >= 0) & (ids_R < num_experts), ids_R, num_experts)  # zero experts, none: no queue
  return plan_lib.rank_in_group(ids_R, num_experts).reshape(k, tokens).T
