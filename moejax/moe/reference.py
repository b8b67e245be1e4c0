"""The single-device reference MoE: no communication, written plainly; it defines the semantics.

y[t] = sum_c keep[t, c] * w[t, c] * FFN_{e[t, c]}(x[t])   (FFN_e with expert e's biases, `ffn_bias`)
     (with weight_inputs, Llama 4's: sum_c keep[t, c] * FFN_{e[t, c]}(w[t, c] * x[t]))

where e[t, :] are the K experts the routing chooses for token t and w their weights (each router's `reference`,
`moe.routing`: the whole batch routed plainly), and keep[t, c] = 0 only in capacity mode for token-choices past
their expert's capacity. Zero-computation experts (`zero_experts`, ids E .. E + Z - 1) are the identity,
FFN_e(x) = x (the token as it is, never a wire's rounding of it), and hold no capacity queue: never dropped. Capacity is per dispatch group (one device's tokens: the global batch split into
`dispatch_groups` contiguous groups, as the mesh shards it): each group may send each expert
ceil(capacity_factor * group_tokens * k / E) token-choices; all first choices of the group come
before any second choice, and within a choice rank earlier tokens come first.
"""

import functools
import math

import jax
import jax.numpy as jnp

from moejax.moe.config import MoEConfig
from moejax.moe.experts import Activation


def _kept(ids_TxK: jax.Array, cfg: MoEConfig, dispatch_groups: int) -> jax.Array:
  """[T, k] bool: by pairwise comparison, a choice is kept if fewer than C choices precede it."""
  tokens, k = ids_TxK.shape
  group_tokens = tokens // dispatch_groups
  capacity = math.ceil(cfg.capacity_factor * group_tokens * cfg.choices_per_token / cfg.num_experts)
  token = jnp.arange(tokens)[:, None].repeat(k, 1).reshape(-1)
  choice = jnp.arange(k)[None, :].repeat(tokens, 0).reshape(-1)
  expert = ids_TxK.reshape(-1)
  group = token // group_tokens
  same = (expert[:, None] == expert[None, :]) & (group[:, None] == group[None, :])
  before = (choice[None, :] < choice[:, None]) | (
    (choice[None, :] == choice[:, None]) & (token[None, :] < token[:, None])
  )
  ahead = jnp.sum(same & before, axis=1)
  return (ahead < capacity).reshape(tokens, k)


def _kept_choices(ids_TxK: jax.Array, cfg: MoEConfig, dispatch_groups: int) -> jax.Array:
  """[T, k] bool: the choices whose expert output counts; only capacity mode drops any, and never a zero expert's
  (it computes nothing, so it holds no capacity queue)."""
  keep_TxK = jnp.ones_like(ids_TxK, bool) if cfg.capacity_factor is None else _kept(ids_TxK, cfg, dispatch_groups)
  return keep_TxK | (ids_TxK >= cfg.num_experts)


def _expert_outputs(params: dict, x_TxD: jax.Array, e_TxD: jax.Array, cfg: MoEConfig, act: Activation) -> jax.Array:
  """[E + Z, T, d]: every expert applied to every token of e_TxD (plainly, no dispatch), with ffn_bias each expert's
  biases on each matmul; the zero experts return x_TxD, the token as it is rather than a wire's rounding of it."""
  bias = lambda name: params[name][:, None, :] if cfg.ffn_bias else 0.0
  h = jnp.einsum("td,edf->etf", e_TxD, params["w_in"]) + bias("b_in")
  h = act(h) if not cfg.gated else act(jnp.einsum("td,edf->etf", e_TxD, params["w_gate"]) + bias("b_gate"), h)
  outputs = jnp.einsum("etf,efd->etd", h, params["w_out"]) + bias("b_out")
  identity = jnp.broadcast_to(x_TxD, (cfg.zero_experts, *x_TxD.shape))  # the zero experts: each token itself
  return jnp.concatenate([outputs, identity], axis=0)


def _shared_output(params: dict, x_TxD: jax.Array, cfg: MoEConfig, act: Activation) -> jax.Array:
  """[T, d]: the shared experts' dense FFN on every token (scaled by sigmoid(shared_gate) where the model has one),
  added to the routed output as the layer adds it."""
  shared = params["shared"]
  h = x_TxD @ shared["w_in"]
  h = act(h) if not cfg.gated else act(x_TxD @ shared["w_gate"], h)
  out = h @ shared["w_out"]
  if cfg.shared_gate:
    out = jax.nn.sigmoid(x_TxD @ params["shared_gate"]["kernel"]) * out
  return out


def _aux(routed, ids_TxK: jax.Array, keep_TxK: jax.Array, prior, cfg: MoEConfig) -> dict:
  """The layer's aux (losses, kept choices per expert, dropped choices, and the running balance counts with
  global-batch balancing), in the layer's keys so that tests compare the two directly."""
  num_experts = cfg.num_experts
  kept_counts = jnp.sum(jax.nn.one_hot(ids_TxK, num_experts + cfg.zero_experts) * keep_TxK[..., None], axis=(0, 1))
  aux = {
    "load_balance_loss": routed.load_balance,
    "z_loss": routed.z_loss,
    "aux_loss": routed.load_balance + routed.z_loss,
    "expert_counts": kept_counts[:num_experts].astype(jnp.int32),
    "tokens_dropped": jnp.sum(~keep_TxK).astype(jnp.int32),
  }
  if cfg.zero_experts:
    aux["zero_expert_counts"] = kept_counts[num_experts:].astype(jnp.int32)
  if prior is not None:
    aux["balance_counts"] = prior + routed.counts
  return aux


# One compiled program per config: called eagerly (tests, the demo), op by op it would compile each op on first use.
@functools.partial(jax.jit, static_argnames=("cfg", "dispatch_groups"))
def moe_reference(
  params: dict,
  x: jax.Array,
  cfg: MoEConfig,
  *,
  dispatch_groups: int = 1,
  noise: jax.Array | None = None,
  expert_bias: jax.Array | None = None,
  balance_counts: jax.Array | None = None,
  expert_x: jax.Array | None = None,
  token_ids: jax.Array | None = None,
  hash_table: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """x [tokens, d] or [batch, seq, d] -> (y like x, aux with the same losses and counts as the layer).

  dispatch_groups: the groups capacity counts within (the mesh's routing devices). noise: router-input
  multiplier [tokens, d] (jitter), or None. expert_bias: the balancing bias [E + Z] added to the scores
  that choose experts. balance_counts: with balance_loss='global_batch', the earlier micro-batches' choice
  counts; aux['balance_counts'] is them plus this call's. expert_x: what the routed experts see where it differs
  from what the router sees (rows quantised on the wire: `moe.wire.round_trip(x, 'float8_e4m3fn')`). token_ids:
  the tokens' ids (x's shape without d), which routing='hash' chooses experts by; hash_table: with hash_vocab, each
  id's experts [V, K] (None: the hash's).
  """
  x_TxD = x.reshape(-1, cfg.d_model).astype(jnp.float32)
  router_in = x_TxD if noise is None else x_TxD * noise
  prior = None
  if cfg.balance_loss == "global_batch":
    prior = jnp.zeros((cfg.balance_counts_size,)) if balance_counts is None else jnp.asarray(balance_counts)
  ids_T = None if token_ids is None else jnp.asarray(token_ids).reshape(-1)
  sequence_length = x.shape[1] if x.ndim == 3 else None
  routed = cfg.router.reference(router_in, params, expert_bias, sequence_length, prior, ids_T, None, hash_table)
  ids_TxK, weights_TxK = routed.ids, routed.weights
  keep_TxK = _kept_choices(ids_TxK, cfg, dispatch_groups)

  act = Activation.of(cfg)
  e_TxD = x_TxD if expert_x is None else expert_x.reshape(-1, cfg.d_model).astype(jnp.float32)
  tokens_T = jnp.arange(x_TxD.shape[0])
  if cfg.weight_inputs:  # each choice's expert sees the token times the choice's weight
    scaled = lambda a_TxD, c: a_TxD * weights_TxK[:, c, None]
    outputs = [_expert_outputs(params, scaled(x_TxD, c), scaled(e_TxD, c), cfg, act) for c in range(ids_TxK.shape[1])]
    chosen_TxKxD = jnp.stack([out[ids_TxK[:, c], tokens_T] for c, out in enumerate(outputs)], axis=1)
    weights_TxK = jnp.ones_like(weights_TxK)
  else:
    chosen_TxKxD = _expert_outputs(params, x_TxD, e_TxD, cfg, act)[ids_TxK, tokens_T[:, None]]  # of [E + Z, T, d]
  y_TxD = jnp.sum(jnp.where(keep_TxK, weights_TxK, 0.0)[..., None] * chosen_TxKxD, axis=1)
  if cfg.num_shared_experts:  # dense FFNs on every token, added to the routed output
    y_TxD = y_TxD + _shared_output(params, x_TxD, cfg, act)
  return y_TxD.reshape(x.shape).astype(x.dtype), _aux(routed, ids_TxK, keep_TxK, prior, cfg)
