"""SMILE's bi-level router (Eq. 3): a softmax node router [d, n] picks a token's node_top_k nodes, a softmax local
router [d, m'], shared by every node, its top_k local experts there; a choice's weight is p_node * q_local."""

import jax
import jax.numpy as jnp

from moejax.moe.routing import base
from moejax.moe.routing import scores as scores_lib
from moejax.moe.routing.base import Blocks, ReferenceRoute, RoutingDecision
from moejax.validation import require


class BiLevel(base.Router):
  """'bilevel'. Choice (a, b), the a-th node and its b-th local expert, has rank a * top_k + b."""

  name = "bilevel"
  chooses_nodes = True
  shares_local_router = True
  default_alpha = 0.005  # SMILE's alpha and beta
  zero_refusal = (
    "SMILE chooses a node, then a local expert there by a router shared by every node, weight p_node * q_local: a zero "
    "expert runs on no node (on the token's own device), so neither router has a column for it"
  )

  @property
  def widths(self):
    return {"node_router": self.cfg.num_nodes, "local_router": self.cfg.experts_per_node}

  def check(self):
    super().check()
    cfg = self.cfg
    require(
      cfg.score == scores_lib.SOFTMAX,
      "score",
      cfg.score,
      "'softmax' with routing='bilevel' (SMILE's weight is the product of two softmax routers)",
    )
    require(
      cfg.bias_update_rate == 0,
      "bias_update_rate",
      cfg.bias_update_rate,
      "0 with routing='bilevel' (SMILE balances its two routers with its additive loss; the bias acts on "
      "one flat router's scores)",
    )
    require(
      cfg.balance_loss != "sequence",
      "balance_loss",
      cfg.balance_loss,
      "'batch' or 'global_batch' with routing='bilevel' (DeepSeek-V3's sequence-wise loss is over one flat "
      "router's choices; SMILE's Eq. 4 balances the node and the local router over the batch)",
    )
    require(
      not cfg.router_bias,
      "router_bias",
      cfg.router_bias,
      "False with routing='bilevel' (a bias on one flat router's logits)",
    )

  @property
  def choices_per_token(self):
    return self.cfg.top_k * self.cfg.node_top_k

  @property
  def max_top_k(self):
    return self.cfg.experts_per_node

  @property
  def placement_blocks(self):
    return Blocks(
      self.cfg.num_nodes,
      "node",
      "bilevel picks a node, then one of its experts by the local router shared by all nodes",
    )

  @property
  def columns(self):
    return {"node_router": "block", "local_router": "local"}

  def balance_terms(self):
    cfg = self.cfg
    return [("node_router", cfg.alpha, cfg.node_top_k), ("local_router", cfg.beta, cfg.top_k)]

  def route(
    self, x_TxD, params, bias_E=None, sequence_length=None, token_ids_T=None, hash_index_S=None, hash_table_VxK=None
  ):
    del (
      bias_E,
      sequence_length,
      token_ids_T,
      hash_index_S,
      hash_table_VxK,
    )  # refused with 'bilevel' by MoEConfig; ids unused
    cfg, tokens = self.cfg, x_TxD.shape[0]
    node_logits, p_TxN = base.softmax_router(x_TxD, params, "node_router")
    local_logits, q_TxL = base.softmax_router(x_TxD, params, "local_router")
    p_top, nodes = jax.lax.top_k(p_TxN, cfg.node_top_k)
    q_top, local = jax.lax.top_k(q_TxL, cfg.top_k)
    ids = (nodes[:, :, None] * cfg.experts_per_node + local[:, None, :]).reshape(tokens, -1)
    weights = (p_top[:, :, None] * q_top[:, None, :]).reshape(tokens, -1)
    stats = {
      "counts": {
        "node_router": base.counts(nodes, cfg.num_nodes),
        "local_router": base.counts(local, cfg.experts_per_node),
      },
      "prob_sums": {"node_router": jnp.sum(p_TxN, axis=0), "local_router": jnp.sum(q_TxL, axis=0)},
      "z_sum": base.z_sum(node_logits) + base.z_sum(local_logits),
      "tokens": jnp.asarray(tokens, jnp.float32),
    }
    return RoutingDecision(ids.astype(jnp.int32), base.renormalized(weights, cfg)), stats

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
    del bias_E, sequence_length, token_ids_T, hash_index_S, hash_table_VxK
    cfg, n = self.cfg, self.cfg.num_nodes
    node_logits = x_TxD @ params["node_router"]["kernel"]
    local_logits = x_TxD @ params["local_router"]["kernel"]
    p, q = jax.nn.softmax(node_logits, -1), jax.nn.softmax(local_logits, -1)
    p_top, nodes = jax.lax.top_k(p, cfg.node_top_k)
    q_top, local = jax.lax.top_k(q, cfg.top_k)
    ids, weights = [], []
    for a in range(cfg.node_top_k):
      for b in range(cfg.top_k):
        ids.append(nodes[:, a] * cfg.experts_per_node + local[:, b])
        weights.append(p_top[:, a] * q_top[:, b])
    load_balance = base.switch_loss(nodes, p, cfg.alpha, None if prior is None else prior[:n]) + base.switch_loss(
      local, q, cfg.beta, None if prior is None else prior[n:]
    )
    z = lambda logits: jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    made = jnp.concatenate([base.counts(nodes, n), base.counts(local, cfg.experts_per_node)])
    return ReferenceRoute(
      jnp.stack(ids, 1),
      base.renormalized(jnp.stack(weights, 1), cfg),
      load_balance,
      cfg.z_loss_coef * (z(node_logits) + z(local_logits)),
      made,
    )
