"""The single-device reference MoE: no communication, written plainly; it defines the semantics.

y[t] = sum_c keep[t, c] * w[t, c] * FFN_{e[t, c]}(x[t])

where e[t, :] are the top-k experts of token t under softmax(x[t] @ router), w their (optionally
renormalised) probabilities, and keep[t, c] = 0 only in capacity mode for token-choices past their
expert's capacity. Capacity is per dispatch group (one device's tokens: the global batch split into
`num_groups` contiguous groups, as the mesh shards it): each group may send each expert
ceil(capacity_factor * group_tokens * k / E) token-choices; all first choices of the group come
before any second choice, and within a choice rank earlier tokens come first.
"""

import math

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.experts import ACTIVATIONS


def _kept(ids_TxK: jax.Array, cfg: MoEConfig, num_groups: int) -> jax.Array:
  """[T, k] bool: by pairwise comparison, a choice is kept if fewer than C choices precede it."""
  tokens, k = ids_TxK.shape
  group_tokens = tokens // num_groups
  capacity = math.ceil(cfg.capacity_factor * group_tokens * k / cfg.num_experts)
  token = jnp.arange(tokens)[:, None].repeat(k, 1).reshape(-1)
  choice = jnp.arange(k)[None, :].repeat(tokens, 0).reshape(-1)
  expert = ids_TxK.reshape(-1)
  group = token // group_tokens
  same = (expert[:, None] == expert[None, :]) & (group[:, None] == group[None, :])
  before = (choice[None, :] < choice[:, None]) | ((choice[None, :] == choice[:, None]) & (token[None, :] < token[:, None]))
  ahead = jnp.sum(same & before, axis=1)
  return (ahead < capacity).reshape(tokens, k)


def moe_reference(params: dict, x: jax.Array, cfg: MoEConfig, *, num_groups: int = 1,
                  noise: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """x [tokens, d] or [batch, seq, d] -> (y like x, aux with the same losses and counts as the layer).

  num_groups: dispatch groups for capacity mode (the mesh's device count). noise: router-input
  multiplier [tokens, d] (jitter), or None.
  """
  x_TxD = x.reshape(-1, cfg.d_model).astype(jnp.float32)
  tokens, k, num_experts = x_TxD.shape[0], cfg.top_k, cfg.num_experts
  router_in = x_TxD if noise is None else x_TxD * noise
  logits = router_in @ params["router"]["kernel"].astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if cfg.renormalize:
    weights = weights / weights.sum(-1, keepdims=True)
  keep = jnp.ones_like(ids, bool) if cfg.capacity_factor is None else _kept(ids, cfg, num_groups)

  act = ACTIVATIONS[cfg.activation]
  # Every expert applied to every token: [E, T, d].
  h = jnp.einsum("td,edf->etf", x_TxD, params["w_in"])
  h = act(h) if not cfg.gated else act(jnp.einsum("td,edf->etf", x_TxD, params["w_gate"])) * h
  outputs = jnp.einsum("etf,efd->etd", h, params["w_out"])
  chosen = outputs[ids, jnp.arange(tokens)[:, None]]  # [T, k, d]
  y = jnp.sum(jnp.where(keep, weights, 0.0)[..., None] * chosen, axis=1)

  onehot = jax.nn.one_hot(ids, num_experts)  # [T, k, E]
  f = onehot.sum((0, 1)) / (tokens * k)
  load_balance = cfg.load_balance_coef * num_experts * jnp.sum(f * probs.mean(0))
  z_loss = cfg.z_loss_coef * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  aux = {
      "load_balance_loss": load_balance,
      "z_loss": z_loss,
      "aux_loss": load_balance + z_loss,
      "expert_counts": jnp.sum(onehot * keep[..., None], axis=(0, 1)).astype(jnp.int32),
      "tokens_dropped": jnp.sum(~keep).astype(jnp.int32),
  }
  return y.reshape(x.shape).astype(x.dtype), aux
