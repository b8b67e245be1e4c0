"""The flat routers: one router [d, E] over all experts (topk), optionally limited to each token's best groups of
contiguous experts (group-limited, DeepSeek-V2/V3), of which node_limited is the case groups = nodes."""

import jax
import jax.numpy as jnp

from moejax.moe.routing import base
from moejax.moe.routing import scores as scores_lib
from moejax.moe.routing.base import Blocks, ReferenceRoute, RoutingDecision


class TopK(base.Router):
  """'topk': scores softmax (Switch k=1, GShard k=2) or sigmoid (DeepSeek-V3) of x @ router (+ router.bias with
  router_bias: gpt-oss, whose softmax over its k best logits is the softmax renormalised over them), the top k of the
  scores (+ the balancing bias) among the allowed experts, weighted by their scores (renormalised, scaled)."""

  name = "topk"
  limits_groups = True

  @property
  def widths(self):
    return {"router": self.scored}  # the real experts, then the zero experts

  @property
  def group_limit(self):
    cfg = self.cfg
    return None if cfg.num_groups is None else (cfg.num_groups, cfg.topk_groups)

  @property
  def group_score(self) -> str:
    return self.cfg.group_score

  @property
  def max_top_k(self):
    limit, cfg = self.group_limit, self.cfg
    real = cfg.num_experts if limit is None else cfg.num_experts // limit[0] * limit[1]
    return real + cfg.zero_experts  # zero experts belong to no group: always allowed

  @property
  def placement_blocks(self):
    cfg = self.cfg
    if cfg.num_groups is None or cfg.topk_groups >= cfg.num_groups:  # every group kept: no limit
      return None
    return Blocks(
      cfg.num_groups,
      "group",
      f"with num_groups={cfg.num_groups}, topk_groups={cfg.topk_groups} "
      f"(group-limited routing) a token's experts are chosen among its {cfg.topk_groups} best groups of "
      f"{cfg.num_experts // cfg.num_groups} contiguous experts, each scored by its own experts "
      f"({cfg.group_score!r})",
    )

  def balance_terms(self):
    return [("router", self.cfg.alpha, self.cfg.top_k)]

  def _scores(self, x_TxD, params):
    """(logits, scores that weight, probabilities the balance loss takes) [T, E]."""
    logits = jnp.dot(x_TxD.astype(jnp.float32), params["router"]["kernel"].astype(jnp.float32))
    if self.cfg.router_bias:  # gpt-oss: top-k of the biased logits, softmax over the k = these renormalised
      logits = logits + params["router"]["bias"].astype(jnp.float32)
    return (logits, *scores_lib.SCORES[self.cfg.score](logits))

  def _weights(self, scores_TxE, ids_TxK):
    weights = jnp.take_along_axis(scores_TxE, ids_TxK, axis=1)
    return base.renormalized(weights, self.cfg) * self.cfg.routed_scaling  # V3 Eq. 13 with renormalize

  def choose(self, select_TxE, token_ids_T, hash_index_S, hash_table_VxK=None):
    """[T, K] the chosen experts: the top k of the selection scores (token ids, hash index and table unused)."""
    return jax.lax.top_k(select_TxE, self.cfg.top_k)[1]

  def route(
    self, x_TxD, params, bias_E=None, sequence_length=None, token_ids_T=None, hash_index_S=None, hash_table_VxK=None
  ):
    cfg = self.cfg
    logits, scores_TxE, probs_TxE = self._scores(x_TxD, params)
    select_TxE = scores_TxE if bias_E is None else scores_TxE + bias_E
    if self.group_limit is not None:
      select_TxE = _limit_to_groups(select_TxE, *self.group_limit, self.group_score, cfg.num_experts)
    ids = self.choose(select_TxE, token_ids_T, hash_index_S, hash_table_VxK)
    stats = {
      "counts": {"router": base.counts(ids, self.scored)},
      "prob_sums": {"router": jnp.sum(probs_TxE, axis=0)},
      "z_sum": base.z_sum(logits),
      "tokens": jnp.asarray(x_TxD.shape[0], jnp.float32),
    }
    if cfg.balance_loss == "sequence":
      stats["sequence_loss_sum"], stats["sequences"] = _sequence_loss_sum(ids, probs_TxE, sequence_length, cfg)
    return RoutingDecision(ids.astype(jnp.int32), self._weights(scores_TxE, ids)), stats

  def reference(
    self,
    x_TxD,
    params,
    bias_E=None,
    sequence_length=None,
    prior=None,
    token_ids_T=None,
    hash_index_S=None,
    hash_table_VxK=None,
  ):
    cfg = self.cfg
    logits, scores, probs = self._scores(x_TxD, params)
    select = scores if bias_E is None else scores + bias_E[None, :]
    if self.group_limit is not None:  # groups ranked by the sum of their two best selection scores, or their best
      groups, kept = self.group_limit
      best = 1 if self.group_score == "max" else 2
      group_scores = jnp.sort(select[:, : cfg.num_experts].reshape(select.shape[0], groups, -1), axis=-1)[..., ::-1][
        ..., :best
      ].sum(-1)
      _, chosen_groups = jax.lax.top_k(group_scores, kept)
      group_of_expert = jnp.arange(cfg.num_experts) // (cfg.num_experts // groups)
      allowed = (group_of_expert[None, :, None] == chosen_groups[:, None, :]).any(-1)
      allowed = jnp.concatenate([allowed, jnp.ones((len(select), cfg.zero_experts), bool)], 1)  # zero: no group
      select = jnp.where(allowed, select, -jnp.inf)
    ids = self.choose(select, token_ids_T, hash_index_S, hash_table_VxK)
    if cfg.balance_loss == "sequence":  # DeepSeek-V3 Eqs. 17-20, averaged over sequences
      pieces = x_TxD.shape[0] // sequence_length
      losses = [base.switch_loss(i, p, 1.0) for i, p in zip(jnp.split(ids, pieces), jnp.split(probs, pieces))]
      load_balance = cfg.alpha * jnp.mean(jnp.stack(losses))
    else:
      load_balance = base.switch_loss(ids, probs, cfg.alpha, prior)
    z_loss = cfg.z_loss_coef * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return ReferenceRoute(ids, self._weights(scores, ids), load_balance, z_loss, base.counts(ids, self.scored))


class NodeLimited(TopK):
  """'node_limited' (DeepSeek-V3's device-limited routing): the flat router, a token's experts chosen among its
  node_top_k best nodes, each node scored by the sum of its two best expert scores: group-limited routing with
  groups = nodes."""

  name = "node_limited"
  chooses_nodes = True
  limits_groups = False
  group_score = "top2_sum"

  @property
  def group_limit(self):
    return self.cfg.num_nodes, self.cfg.node_top_k

  @property
  def placement_blocks(self):
    return Blocks(self.cfg.num_nodes, "node", "node_limited ranks a token's nodes by their own experts' probabilities")


def _limit_to_groups(select_TxE, groups: int, kept: int, group_score: str, num_experts: int):
  """Group-limited routing (DeepSeek-V2/V3): groups of E / groups contiguous experts, each scored by the sum
  of its two best selection scores ('top2_sum', V3) or its best ('max', V2); experts outside a token's `kept`
  best groups are masked out. Columns past the E real experts (zero experts: on no node, in no group, costing no
  traffic) stay allowed."""
  select_TxE, zero_TxZ = select_TxE[:, :num_experts], select_TxE[:, num_experts:]
  tokens = select_TxE.shape[0]
  per_group = num_experts // groups
  best = 1 if group_score == "max" else min(2, per_group)
  group_scores = jnp.sum(jax.lax.top_k(select_TxE.reshape(tokens, groups, per_group), best)[0], -1)
  _, best_groups = jax.lax.top_k(group_scores, kept)
  allowed_groups = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best_groups].set(True)
  return jnp.concatenate([jnp.where(jnp.repeat(allowed_groups, per_group, axis=1), select_TxE, -jnp.inf), zero_TxZ], 1)


def _sequence_loss_sum(ids_TxK, probs_TxE, sequence_length: int, cfg):
  """(sum over these tokens' sequences of sum_e f_e P_e, the number of sequences): DeepSeek-V3 Eqs. 17-20
  without alpha, f_e = E / (K L) x the sequence's choices of e, P_e = its mean normalised score."""
  sequences, width = ids_TxK.shape[0] // sequence_length, probs_TxE.shape[1]  # width: E + Z, every scored expert
  counts_BxE = jax.vmap(lambda ids: base.counts(ids, width))(ids_TxK.reshape(sequences, -1))
  f_BxE = counts_BxE * width / (cfg.top_k * sequence_length)
  p_BxE = probs_TxE.reshape(sequences, sequence_length, -1).mean(axis=1)
  return jnp.sum(f_BxE * p_BxE), jnp.asarray(sequences, jnp.float32)
