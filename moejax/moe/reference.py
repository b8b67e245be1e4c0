"""The single-device reference MoE: no communication, written plainly; it defines the semantics.

y[t] = sum_c keep[t, c] * w[t, c] * FFN_{e[t, c]}(x[t])

where e[t, :] are the K experts the routing chooses for token t (topk: the top-k of
softmax(x[t] @ router); bilevel: expert j of node i for the top nodes i of softmax(x[t] @ node_router)
and the top local experts j of softmax(x[t] @ local_router), weight p_i * q_j; node_limited: the
top-k among the experts of the best nodes), w their (optionally renormalised) weights, and
keep[t, c] = 0 only in capacity mode for token-choices past their
expert's capacity. Capacity is per dispatch group (one device's tokens: the global batch split into
`num_groups` contiguous groups, as the mesh shards it): each group may send each expert
ceil(capacity_factor * group_tokens * k / E) token-choices; all first choices of the group come
before any second choice, and within a choice rank earlier tokens come first.
"""

import math

import jax
import jax.numpy as jnp

from moejax.moe.config import MoEConfig
from moejax.moe.experts import ACTIVATIONS


def _kept(ids_TxK: jax.Array, cfg: MoEConfig, num_groups: int) -> jax.Array:
  """[T, k] bool: by pairwise comparison, a choice is kept if fewer than C choices precede it."""
  tokens, k = ids_TxK.shape
  group_tokens = tokens // num_groups
  capacity = math.ceil(cfg.capacity_factor * group_tokens * cfg.choices_per_token / cfg.num_experts)
  token = jnp.arange(tokens)[:, None].repeat(k, 1).reshape(-1)
  choice = jnp.arange(k)[None, :].repeat(tokens, 0).reshape(-1)
  expert = ids_TxK.reshape(-1)
  group = token // group_tokens
  same = (expert[:, None] == expert[None, :]) & (group[:, None] == group[None, :])
  before = (choice[None, :] < choice[:, None]) | ((choice[None, :] == choice[:, None]) & (token[None, :] < token[:, None]))
  ahead = jnp.sum(same & before, axis=1)
  return (ahead < capacity).reshape(tokens, k)


def _choice_counts(chosen_TxK, num):
  return jax.nn.one_hot(chosen_TxK, num).sum((0, 1))


def _switch_loss(chosen_TxK, probs_TxE, coef, prior_E=None):
  """coef * E * sum_e f_e * P_e: f = fraction of choices made for e (with prior_E, of these choices and the
  prior counts together), P = mean probability of e."""
  num = probs_TxE.shape[1]
  counts = _choice_counts(chosen_TxK, num)
  f = counts / chosen_TxK.size if prior_E is None else (counts + prior_E) / (chosen_TxK.size + prior_E.sum())
  return coef * num * jnp.sum(f * probs_TxE.mean(0))


def _z(logits):
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def _route(x_TxD, params, cfg, bias=None, sequence_length=None, prior=None):
  """(ids [T, K], weights [T, K], load-balance loss, z-loss, the balanced routers' choice counts) for the
  configured routing; prior: the earlier micro-batches' counts ('global_batch')."""
  if cfg.routing == "bilevel":
    node_logits = x_TxD @ params["node_router"]["kernel"]
    local_logits = x_TxD @ params["local_router"]["kernel"]
    p, q = jax.nn.softmax(node_logits, -1), jax.nn.softmax(local_logits, -1)
    p_top, nodes = jax.lax.top_k(p, cfg.node_top_k)
    q_top, local = jax.lax.top_k(q, cfg.top_k)
    ids, weights = [], []
    for a in range(cfg.node_top_k):  # Choice rank a * top_k + b: a-th node, b-th local expert.
      for b in range(cfg.top_k):
        ids.append(nodes[:, a] * cfg.experts_per_node + local[:, b])
        weights.append(p_top[:, a] * q_top[:, b])
    n = cfg.num_nodes
    load_balance = (_switch_loss(nodes, p, cfg.alpha, None if prior is None else prior[:n])
                    + _switch_loss(local, q, cfg.beta, None if prior is None else prior[n:]))
    z_loss = cfg.z_loss_coef * (_z(node_logits) + _z(local_logits))
    weights = jnp.stack(weights, 1)
    if cfg.renormalize:
      weights = weights / weights.sum(-1, keepdims=True)
    counts = jnp.concatenate([_choice_counts(nodes, n), _choice_counts(local, cfg.experts_per_node)])
    return jnp.stack(ids, 1), weights, load_balance, z_loss, counts
  logits = x_TxD @ params["router"]["kernel"]
  if cfg.score == "softmax":
    scores = probs = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdims=True)
  select = scores if bias is None else scores + bias[None, :]
  limit = (cfg.num_nodes, cfg.node_top_k) if cfg.routing == "node_limited" else (
      None if cfg.num_groups is None else (cfg.num_groups, cfg.topk_groups))
  if limit is not None:  # groups ranked by the sum of their two best selection scores, or their best
    groups, kept = limit
    per_group = select.reshape(select.shape[0], groups, -1)
    best = 1 if cfg.group_score == "max" and cfg.routing == "topk" else 2
    group_scores = jnp.sort(per_group, axis=-1)[..., ::-1][..., :best].sum(-1)
    _, chosen_groups = jax.lax.top_k(group_scores, kept)
    group_of_expert = jnp.arange(cfg.num_experts) // (cfg.num_experts // groups)
    allowed = (group_of_expert[None, :, None] == chosen_groups[:, None, :]).any(-1)
    select = jnp.where(allowed, select, -jnp.inf)
  _, ids = jax.lax.top_k(select, cfg.top_k)
  weights = jnp.take_along_axis(scores, ids, axis=1)
  if cfg.renormalize:
    weights = weights / weights.sum(-1, keepdims=True)
  weights = weights * cfg.routed_scaling
  if cfg.balance_loss == "sequence":  # DeepSeek-V3 Eqs. 17-20, averaged over sequences
    losses = [_switch_loss(ids_s, probs_s, 1.0) for ids_s, probs_s in
              zip(jnp.split(ids, ids.shape[0] // sequence_length), jnp.split(probs, probs.shape[0] // sequence_length))]
    load_balance = cfg.alpha * jnp.mean(jnp.stack(losses))
  else:
    load_balance = _switch_loss(ids, probs, cfg.alpha, prior)
  return ids, weights, load_balance, cfg.z_loss_coef * _z(logits), _choice_counts(ids, cfg.num_experts)


def moe_reference(params: dict, x: jax.Array, cfg: MoEConfig, *, num_groups: int = 1,
                  noise: jax.Array | None = None, expert_bias: jax.Array | None = None,
                  balance_counts: jax.Array | None = None, expert_x: jax.Array | None = None
                  ) -> tuple[jax.Array, dict]:
  """x [tokens, d] or [batch, seq, d] -> (y like x, aux with the same losses and counts as the layer).

  num_groups: dispatch groups for capacity mode (the mesh's device count). noise: router-input
  multiplier [tokens, d] (jitter), or None. expert_bias: the balancing bias [E] added to the scores
  that choose experts. balance_counts: with balance_loss='global_batch', the earlier micro-batches' choice
  counts; aux['balance_counts'] is them plus this call's. expert_x: what the routed experts see where it differs
  from what the router sees (rows quantised on the wire: `moe.wire.round_trip(x, 'float8_e4m3fn')`).
  """
  x_TxD = x.reshape(-1, cfg.d_model).astype(jnp.float32)
  tokens, num_experts = x_TxD.shape[0], cfg.num_experts
  router_in = x_TxD if noise is None else x_TxD * noise
  prior = None
  if cfg.balance_loss == "global_batch":
    prior = jnp.zeros((cfg.balance_counts_size,)) if balance_counts is None else jnp.asarray(balance_counts)
  ids, weights, load_balance, z_loss, counts = _route(router_in, params, cfg, expert_bias,
                                                      x.shape[1] if x.ndim == 3 else None, prior)
  keep = jnp.ones_like(ids, bool) if cfg.capacity_factor is None else _kept(ids, cfg, num_groups)

  act = ACTIVATIONS[cfg.activation]
  # Every expert applied to every token: [E, T, d].
  e_TxD = x_TxD if expert_x is None else expert_x.reshape(-1, cfg.d_model).astype(jnp.float32)
  h = jnp.einsum("td,edf->etf", e_TxD, params["w_in"])
  h = act(h) if not cfg.gated else act(jnp.einsum("td,edf->etf", e_TxD, params["w_gate"])) * h
  outputs = jnp.einsum("etf,efd->etd", h, params["w_out"])
  chosen = outputs[ids, jnp.arange(tokens)[:, None]]  # [T, k, d]
  y = jnp.sum(jnp.where(keep, weights, 0.0)[..., None] * chosen, axis=1)
  if cfg.num_shared_experts:  # dense FFNs on every token, added to the routed output
    shared = params["shared"]
    h = x_TxD @ shared["w_in"]
    h = act(h) if not cfg.gated else act(x_TxD @ shared["w_gate"]) * h
    out = h @ shared["w_out"]
    if cfg.shared_gate:
      out = jax.nn.sigmoid(x_TxD @ params["shared_gate"]["kernel"]) * out
    y = y + out

  onehot = jax.nn.one_hot(ids, num_experts)  # [T, K, E]
  aux = {
      "load_balance_loss": load_balance,
      "z_loss": z_loss,
      "aux_loss": load_balance + z_loss,
      "expert_counts": jnp.sum(onehot * keep[..., None], axis=(0, 1)).astype(jnp.int32),
      "tokens_dropped": jnp.sum(~keep).astype(jnp.int32),
  }
  if prior is not None:
    aux["balance_counts"] = prior + counts
  return y.reshape(x.shape).astype(x.dtype), aux
