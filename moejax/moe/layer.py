"""The expert-parallel MoE layer's one assembly: `moe_apply`, the functional core (`moe.module.MoELayer` wraps it).

Inside `jax.shard_map` over the ('node', 'gpu') mesh each device routes its own tokens, sends each
token-choice to the device holding its expert, runs its local experts on what it received, sends
the results back and combines them with the router weights (README.md, "What moejax is").
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe import local_experts, routing
from moejax.moe import plan as plan_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe import schedule as schedule_lib
from moejax.moe.config import MoEConfig
from moejax.moe.experts import shared_experts
from moejax.moe.layout import Layout, check_inputs
from moejax.moe.packed_sums import psum_packed
from moejax.moe.params import param_specs
from moejax.moe.routing import zero
from moejax.moe.traffic import device_traffic, traffic_bytes
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES, GPU, NODE
from moejax.validation import ConfigError

# aux entries that are totals over the mesh (replicated); expert_ids is sharded like the tokens.
AUX_TOTALS = (
  "load_balance_loss",
  "z_loss",
  "aux_loss",
  "expert_counts",
  "tokens_dropped",
  "tokens_overflowed",
  "traffic_rows",
  "traffic_bytes",
  "nonfinite_tokens",
)


def moe_apply(
  params: dict,
  x: jax.Array,
  cfg: MoEConfig,
  mesh: jax.sharding.Mesh,
  *,
  rng: jax.Array | None = None,
  train: bool = False,
  slot_expert: jax.Array | None = None,
  expert_bias: jax.Array | None = None,
  balance_counts: jax.Array | None = None,
  token_ids: jax.Array | None = None,
  hash_index: jax.Array | None = None,
  hash_table: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
  """The MoE layer: x [tokens, d] or [batch, seq, d] -> (y like x, aux).

  x and y are sharded over both mesh axes, or with expert sharding (cfg.esp_schedule) over 'node' and
  replicated over 'gpu'. aux: load_balance_loss, z_loss, aux_loss (their sum; add it to the training
  loss), expert_counts [E] (token-choices each expert processed), tokens_dropped (token-choices
  dropped by capacity), tokens_overflowed (token-choices dropped because a receive buffer was full; see
  buffer_factor), traffic_rows [hops, A, A] (rows sent from flat device s to flat device p in each
  exchange hop, the Dump's copies included; `traffic_summary` splits them into inter- and intra-node
  traffic), expert_ids [T, K] (each token's routed experts, dropped or not, ids >= E the zero experts; sharded
  like x), with cfg.zero_experts zero_expert_counts [Z] (their choices, none of which crossed the wire).
  rng: needed only for router jitter when train=True and cfg.jitter > 0.
  slot_expert: optional [A, Z] int, the logical expert of each physical slot (Lina's replication;
    `moejax.replication.rebalance`), A = the devices (the nodes with expert sharding): the experts run
    as copies in those slots (`moe.replicas`), with the same result; expert_counts stay per logical expert.
  expert_bias: optional [E + Z] (Z = cfg.zero_experts), DeepSeek-V3's balancing bias (cfg.bias_update_rate), added to the scores
    that choose the experts, never to the weights.
  balance_counts: with balance_loss='global_batch', the choice counts [cfg.balance_counts_size] of the
    step's earlier micro-batches (None: none); aux['balance_counts'] returns them plus this call's, the
    next micro-batch's input.
  token_ids: the tokens' ids, x's shape without d (int), which routing='hash' chooses experts by (required there).
  hash_index: with routing='hash', optional [E + Z] int, the index each expert the hash names sits at after a
    placement moved the experts (`moejax.placement.apply.permute_expert_state`); None: where it started.
  hash_table: with routing='hash' and cfg.hash_vocab = V, optional [V, K] int, each token id's experts (DeepSeek-V4's
    tid2eid; None: the hash's, `routing.hashed.initial_table`); ids outside [0, V) are refused where concrete, else
    clipped and counted in aux['hash_ids_clipped'] (with hash_vocab only).
  """
  # Every input checked before tracing (a slot table's contents too).
  lay = check_inputs(params, x, cfg, mesh, slot_expert, expert_bias, balance_counts, token_ids, hash_index, hash_table)
  return _moe_apply(
    params,
    x,
    cfg,
    mesh,
    lay,
    rng=rng,
    train=train,
    slot_expert=slot_expert,
    expert_bias=expert_bias,
    balance_counts=balance_counts,
    token_ids=token_ids,
    hash_index=hash_index,
    hash_table=hash_table,
  )


# Jitted so that eager calls (notebooks, MoELayer outside jit) compile once instead of running
# shard_map op by op; inside an outer jit it is inlined.
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "lay", "train"))
def _moe_apply(
  params, x, cfg, mesh, lay: Layout, *, rng, train, slot_expert, expert_bias, balance_counts, token_ids, **hashing
):
  """`moe_apply` after the checks; hashing: hash_index and hash_table (routing='hash')."""
  x_TxD = x.reshape(-1, cfg.d_model)
  extras, extra_specs = {}, {}
  if cfg.router.needs_token_ids:  # sharded like the tokens
    extras["token_ids"], extra_specs["token_ids"] = jnp.asarray(token_ids, jnp.int32).reshape(-1), lay.x_spec
  for name, value in hashing.items():  # replicated: a table [V, K] crosses no device per token
    if value is not None:
      extras[name], extra_specs[name] = jnp.asarray(value, jnp.int32), P()
  if expert_bias is not None:
    extras["bias"], extra_specs["bias"] = jnp.asarray(expert_bias, jnp.float32), P()
  if cfg.balance_loss == "global_batch":
    prior = jnp.zeros((cfg.balance_counts_size,)) if balance_counts is None else balance_counts
    extras["balance_counts"], extra_specs["balance_counts"] = jnp.asarray(prior, jnp.float32), P()
  if slot_expert is not None:
    params = replicas_lib.physical_params(params, slot_expert)
    extras["slots"], extra_specs["slots"] = jnp.asarray(slot_expert, jnp.int32).reshape(-1), P()
  if train and cfg.jitter > 0:
    if rng is None:
      raise ConfigError(f"jitter={cfg.jitter} in training needs an rng")
    extras["noise"] = jax.random.uniform(rng, x_TxD.shape, jnp.float32, 1 - cfg.jitter, 1 + cfg.jitter)
    extra_specs["noise"] = lay.x_spec
  body = functools.partial(_moe_local, cfg=cfg, lay=lay, sequence_length=x.shape[1] if x.ndim == 3 else None)
  check_vma = lay.sharding.needs_vma or not cfg.backend_kind.interprets_on(platform_lib.of_mesh(mesh))
  aux_specs = {name: P() for name in AUX_TOTALS} | {"expert_ids": lay.x_spec}
  if cfg.zero_experts:
    aux_specs["zero_expert_counts"] = P()
  if cfg.balance_loss == "global_batch":
    aux_specs["balance_counts"] = P()
  y_TxD, aux = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(lay.x_spec, param_specs(cfg), extra_specs),
    out_specs=(lay.x_spec, aux_specs),
    check_vma=check_vma,
  )(x_TxD, params, extras)
  if cfg.hash_vocab:  # ids the table has no row for: clipped to [0, V) by the router
    ids = extras["token_ids"]
    aux["hash_ids_clipped"] = jnp.sum((ids < 0) | (ids >= cfg.hash_vocab), dtype=jnp.int32)
  return y_TxD.reshape(x.shape), aux


def exchange_for(lay: Layout) -> schedule_lib.Exchange:
  """Where this layout's rows go: its hops over the mesh, its slots per device, collective and bound, whether
  rows travel once per destination, and the Dump's copies per choice."""
  return schedule_lib.Exchange(
    lay.hops,
    {NODE: lay.n, GPU: lay.m},
    lay.slots,
    lay.collective,
    lay.buffer_rows,
    lay.dedup,
    lay.sharding.copies(lay.m),
    lay.wire,
  )


def one_row_per_slot(x_RxD, ids_RxZ, w_RxZ):
  """Rows with Z slots -> R x Z rows with one slot each (the per-choice exchange, without dedup)."""
  slots = ids_RxZ.shape[1]
  return jnp.repeat(x_RxD, slots, axis=0), ids_RxZ.reshape(-1, 1), w_RxZ.reshape(-1, 1)


def _route(router_in_TxD, params, cfg: MoEConfig, extras: dict, sequence_length: int | None):
  """(decision, stats, keep [T, K]): the router's expert ids and weights [T, K] for this device's tokens; capacity
  keeps each expert's first C choices of this group (a zero expert's always: it holds no queue)."""
  hashing = extras.get("token_ids"), extras.get("hash_index"), extras.get("hash_table")
  decision, stats = routing.route(router_in_TxD, params, cfg, extras.get("bias"), sequence_length, *hashing)
  keep_TxK = jnp.ones_like(decision.expert_ids, bool)
  if cfg.capacity_factor is not None:
    capacity = routing.expert_capacity(cfg, router_in_TxD.shape[0])
    keep_TxK = routing.queue_positions(decision.expert_ids, cfg.num_experts) < capacity
    keep_TxK = keep_TxK | ~zero.real(decision.expert_ids, cfg.num_experts)
  return decision, stats, keep_TxK


def _slots_of(sent, extras: dict, cfg: MoEConfig, lay: Layout):
  """The sent rows' slots and weights [R, Z]: each choice to one replica of its expert (with a slot table), then
  the Dump: to the devices holding the slot (several with d_ff split over them), as consecutive slots."""
  sharding, m = lay.sharding, lay.m
  holder_RxK = sent.ids_RxK
  if "slots" in extras:
    holder_RxK = replicas_lib.to_slots(
      holder_RxK.reshape(-1), extras["slots"], cfg.num_experts, sharding.holder_index(m)
    ).reshape(holder_RxK.shape)
  return sharding.dump(holder_RxK, lay.slots, m), jnp.repeat(sent.w_RxK, sharding.copies(m), axis=1)


def _finish_rows(result, sent, logical_RxK, rows: int, d: int, dtype, lay: Layout):
  """(y [R', d], processed [R', K] (expert ids, -1 where not processed), overflowed): the schedule's rows back on
  the device that sent them. A choice counts as processed only if every copy arrived (its other copies then had
  weight 0)."""
  sharding, m = lay.sharding, lay.m
  y_RxD = result.y_RxD.reshape(rows, -1, d).sum(axis=1)
  arrived_RxK = result.arrived_RxZ.reshape(rows, -1, sharding.copies(m)).all(axis=2)
  y_RxD, arrived_RxK, logical_RxK = sharding.own_rows(m, y_RxD, arrived_RxK, logical_RxK)
  processed_RxK = jnp.where(arrived_RxK, logical_RxK, -1)
  overflowed = jnp.sum((logical_RxK >= 0) & ~arrived_RxK, dtype=jnp.int32)
  return sharding.finish(y_RxD, sent, dtype), processed_RxK, overflowed


def _sum_choices(y_RxD, tokens: int, d: int, dtype, expert_ids_TxK, shared_TxD, lay: Layout, zero_TxD=None):
  """(y [T, d], routed expert ids [T, K]) on the device's own tokens: the sum over each token's choices (rows of
  tokens, or of token-choices), plus the zero experts' part [T, d] of the routed tokens (computed here, never sent)
  and the shared experts' output."""
  sharding = lay.sharding
  y_TxD = y_RxD.reshape(tokens, -1, d).astype(jnp.float32).sum(axis=1)
  if zero_TxD is not None:
    y_TxD = y_TxD + zero_TxD
  y_TxD, routed_TxK = sharding.gather_tokens(y_TxD.astype(dtype)), sharding.gather_tokens(expert_ids_TxK)
  if shared_TxD is not None:
    y_TxD = y_TxD + shared_TxD.astype(y_TxD.dtype)
  return y_TxD, routed_TxK


def _routing_aux(stats, cfg: MoEConfig, extras: dict) -> dict:
  """The router's statistics summed over the routing devices -> the auxiliary losses and, with 'global_batch', the
  running choice counts."""
  aux = routing.aux_losses(stats, cfg, extras.get("balance_counts"))
  if "balance_counts" in extras:
    aux["balance_counts"] = extras["balance_counts"] + routing.balance_counts(stats, cfg)
  return aux


def _summed_statistics(
  cfg: MoEConfig, lay: Layout, stats, keep_TxK, processed_RxK, overflowed, nonfinite, ids_TxK, paths
):
  """The mesh's totals, in one packed all-reduce per (axes, dtype) (`packed_sums`): the router's statistics, the
  choices processed per expert [E], dropped by capacity, overflowed, non-finite tokens, the kept rows each hop moved
  between flat devices [hops, A, A], and with zero experts the choices of each [Z]."""
  sharding = lay.sharding
  named = {
    "stats": (stats, sharding.routed_over),
    "traffic_rows": (device_traffic(paths, lay), AXES),
    "expert_counts": (plan_lib.histogram(processed_RxK, cfg.num_experts), sharding.sent_over),
    "tokens_dropped": (jnp.sum(~keep_TxK, dtype=jnp.int32), sharding.routed_over),
    "tokens_overflowed": (overflowed, sharding.sent_over),
    "nonfinite_tokens": (nonfinite, sharding.routed_over),
  }
  if cfg.zero_experts:
    named["zero_expert_counts"] = (zero.counts(ids_TxK, cfg.num_experts, cfg.zero_experts), sharding.routed_over)
  return psum_packed(named)


def _traffic_bytes(rows, lay: Layout, slots: int, x_TxD):
  """The bytes of the traffic per hop `rows` [hops, A, A] (`traffic.traffic_bytes`)."""
  may_drop = schedule_lib.may_drop(exchange_for(lay))
  return traffic_bytes(rows, lay, x_TxD.shape[1], slots, x_TxD.dtype.itemsize, may_drop)


def _moe_local(x_TxD, params, extras, *, cfg: MoEConfig, lay: Layout, sequence_length: int | None):
  """One device's part of the layer: route -> dispatch -> replicas -> schedule -> finish -> sum over choices.

  x [T, d] this device's tokens -> (y [T, d], aux); extras, when used: the router noise [T, d] (jitter), the
  flat slot table [A * Z] (replication), the balancing bias [E] and the earlier micro-batches' choice
  counts ('global_batch'). What expert sharding changes, `lay.sharding` does (`moe.expert_sharding`). The
  experts weight their outputs, so rows come back as weighted sums (`moe.schedule`)."""
  sharding, m = lay.sharding, lay.m
  # The shared experts need no exchange: computed first, nothing orders them after the dispatch.
  shared_TxD = shared_experts(x_TxD, params, cfg, sharding.shared_sum_over) if cfg.num_shared_experts else None
  router_in = x_TxD * extras["noise"] if "noise" in extras else x_TxD
  x_TxD, router_in = sharding.split_tokens(x_TxD), sharding.split_tokens(router_in)
  if "token_ids" in extras:  # the ids of the tokens this device routes
    extras = extras | {"token_ids": sharding.split_tokens(extras["token_ids"])}
  tokens, d = x_TxD.shape
  decision, stats, keep_TxK = _route(router_in, params, cfg, extras, sequence_length)

  # dispatch: the rows this device sends with their choices, in their slots; a zero expert's choice stays here.
  w_TxK = decision.weights.astype(jnp.float32)
  send_TxK = keep_TxK & zero.real(decision.expert_ids, cfg.num_experts)
  sent = sharding.rows_to_send(x_TxD, decision.expert_ids, send_TxK, w_TxK, lay.rows, m, cfg)
  ids_RxZ, w_RxZ = _slots_of(sent, extras, cfg, lay)
  x_RxD, rows = sent.x_RxD, ids_RxZ.shape[0]
  nonfinite = jnp.sum(~jnp.isfinite(x_TxD).all(axis=1), dtype=jnp.int32)  # NaN/inf stay so on the wire: counted
  if not lay.dedup:
    x_RxD, ids_RxZ, w_RxZ = one_row_per_slot(x_RxD, ids_RxZ, w_RxZ)

  # plan, exchange, experts (weighted), exchange back: in the configured schedule.
  local = local_experts.Experts.of(params, cfg, sharding)
  result = cfg.schedule_kind.run(x_RxD, ids_RxZ, w_RxZ, exchange_for(lay), local, cfg.num_chunks)
  y_RxD, processed_RxK, overflowed = _finish_rows(result, sent, sent.ids_RxK, rows, d, x_TxD.dtype, lay)
  zero_TxD = zero.identity_sum(x_TxD, decision.expert_ids, w_TxK, cfg.num_experts) if cfg.zero_experts else None
  y_TxD, routed_TxK = _sum_choices(y_RxD, tokens, d, x_TxD.dtype, decision.expert_ids, shared_TxD, lay, zero_TxD)

  totals = _summed_statistics(
    cfg, lay, stats, keep_TxK, processed_RxK, overflowed, nonfinite, decision.expert_ids, result.paths
  )
  aux = _routing_aux(totals.pop("stats"), cfg, extras) | totals
  slots = ids_RxZ.shape[1]  # on the wire: Z per row with dedup, 1 once each slot is its own row
  aux["traffic_bytes"] = _traffic_bytes(aux["traffic_rows"], lay, slots, x_TxD)
  aux["expert_ids"] = routed_TxK
  return y_TxD, aux
