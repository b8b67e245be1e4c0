"""The expert-parallel MoE layer's one assembly: `moe_apply`, the functional core (`moe.module.MoELayer` wraps it).

Inside `jax.shard_map` over the ('node', 'gpu') mesh each device routes its own tokens, sends each
token-choice to the device holding its expert, runs its local experts on what it received, sends
the results back and combines them with the router weights (README.md, "What moejax is").
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe import expert_sharding as esp_lib
from moejax.moe import plan as plan_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe import routing
from moejax.moe import schedule as schedule_lib
from moejax.moe import transport as transport_lib
from moejax.moe.config import MoEConfig
from moejax.moe.experts import shared_experts
from moejax.moe.layout import Layout, check_inputs
from moejax.moe.params import param_specs
from moejax.moe.traffic import hop_traffic
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import GPU, NODE
from moejax.validation import ConfigError

# aux entries that are totals over the mesh (replicated); expert_ids is sharded like the tokens.
AUX_TOTALS = ("load_balance_loss", "z_loss", "aux_loss", "expert_counts", "tokens_dropped", "tokens_overflowed",
              "traffic_rows")


def moe_apply(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, *,
              rng: jax.Array | None = None, train: bool = False, slot_expert: jax.Array | None = None,
              expert_bias: jax.Array | None = None, balance_counts: jax.Array | None = None
              ) -> tuple[jax.Array, dict]:
  """The MoE layer: x [tokens, d] or [batch, seq, d] -> (y like x, aux).

  x and y are sharded over both mesh axes, or with expert sharding (cfg.esp_schedule) over 'node' and
  replicated over 'gpu'. aux: load_balance_loss, z_loss, aux_loss (their sum; add it to the training
  loss), expert_counts [E] (token-choices each expert processed), tokens_dropped (token-choices
  dropped by capacity), tokens_overflowed (token-choices dropped because a receive buffer was full; see
  buffer_factor), traffic_rows [hops, A, A] (rows sent from flat device s to flat device p in each
  exchange hop, the Dump's copies included; `traffic_summary` splits them into inter- and intra-node
  traffic), expert_ids [T, K] (each token's routed experts, dropped or not; sharded like x).
  rng: needed only for router jitter when train=True and cfg.jitter > 0.
  slot_expert: optional [A, Z] int, the logical expert of each physical slot (Lina's replication;
    `moejax.replication.rebalance`), A = the devices (the nodes with expert sharding): the experts run
    as copies in those slots (`moe.replicas`), with the same result; expert_counts stay per logical expert.
  expert_bias: optional [E], DeepSeek-V3's balancing bias (cfg.bias_update_rate), added to the scores
    that choose the experts, never to the weights.
  balance_counts: with balance_loss='global_batch', the choice counts [cfg.balance_counts_size] of the
    step's earlier micro-batches (None: none); aux['balance_counts'] returns them plus this call's, the
    next micro-batch's input.
  """
  check_inputs(params, x, cfg, mesh, slot_expert, expert_bias, balance_counts)  # a slot table's contents too
  return _moe_apply(params, x, cfg, mesh, rng=rng, train=train, slot_expert=slot_expert, expert_bias=expert_bias,
                    balance_counts=balance_counts)


# Jitted so that eager calls (notebooks, MoELayer outside jit) compile once instead of running
# shard_map op by op; inside an outer jit it is inlined.
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "train"))
def _moe_apply(params, x, cfg, mesh, *, rng, train, slot_expert, expert_bias, balance_counts):
  lay = check_inputs(params, x, cfg, mesh, slot_expert, expert_bias, balance_counts)
  x_TxD = x.reshape(-1, cfg.d_model)
  extras, extra_specs = {}, {}
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
  platform = platform_lib.of_mesh(mesh)
  body = functools.partial(_moe_local, cfg=cfg, lay=lay, sequence_length=x.shape[1] if x.ndim == 3 else None)
  check_vma = cfg.esp_schedule is not None or platform_lib.check_vma(cfg.expert_backend, platform)
  aux_specs = {name: P() for name in AUX_TOTALS} | {"expert_ids": lay.x_spec}
  if cfg.balance_loss == "global_batch":
    aux_specs["balance_counts"] = P()
  y_TxD, aux = jax.shard_map(body, mesh=mesh, in_specs=(lay.x_spec, param_specs(cfg), extra_specs),
                             out_specs=(lay.x_spec, aux_specs), check_vma=check_vma)(x_TxD, params, extras)
  return y_TxD.reshape(x.shape), aux


def _moe_local(x_TxD, params, extras, *, cfg: MoEConfig, lay: Layout, sequence_length: int | None):
  """One device's part of the layer: route -> plan -> exchange -> experts -> exchange -> combine.

  x [T, d] this device's tokens -> (y [T, d], aux); extras, when used: the router noise [T, d] (jitter), the
  flat slot table [A * Z] (replication), the balancing bias [E] and the earlier micro-batches' choice
  counts ('global_batch')."""
  k, num_experts, esp = cfg.choices_per_token, cfg.num_experts, cfg.esp_schedule
  # The shared experts need no exchange: computed first, nothing orders them after the dispatch.
  shared_TxD = shared_experts(x_TxD, params, cfg) if cfg.num_shared_experts else None
  router_in = x_TxD * extras["noise"] if "noise" in extras else x_TxD
  if esp == "s1":  # PauseMP before the gate: each GPU routes its share of the node's tokens
    x_TxD, router_in = esp_lib.mp_split(x_TxD), esp_lib.mp_split(router_in)
  tokens, d = x_TxD.shape

  # route: expert ids and weights [T, K]; capacity keeps each expert's first C choices of this group.
  decision, stats = routing.route(router_in, params, cfg, extras.get("bias"), sequence_length)
  keep_TxK = jnp.ones_like(decision.expert_ids, bool)
  if cfg.capacity_factor is not None:
    keep_TxK = routing.queue_positions(decision.expert_ids, num_experts) < routing.expert_capacity(cfg, tokens)
  ids_TxK = jnp.where(keep_TxK, decision.expert_ids, -1)

  # the rows this device sends: token-choice rows, with expert sharding's copies or split.
  ids_R, x_RxD = ids_TxK.reshape(-1), jnp.repeat(x_TxD, k, axis=0)
  if esp == "baseline":  # the ESP all-gather: m identical copies of the node's tokens, all sent
    x_RxD, ids_R = jnp.repeat(esp_lib.esp_all_gather(x_TxD), k, axis=0), jnp.tile(ids_R, lay.m)
  elif esp == "s2":  # PauseMP after the gate: this GPU's share of the dispatched tensor
    x_RxD, ids_R, slot_R = esp_lib.dispatched_tensor(x_RxD, ids_R, decision.expert_ids, keep_TxK, lay.rows * lay.m,
                                                     cfg)
    x_RxD, ids_R = esp_lib.mp_split(x_RxD), esp_lib.my_chunk(ids_R)
  logical_R = ids_R
  if "slots" in extras:  # to one replica of each row's expert
    me = jax.lax.axis_index(NODE) if esp is not None else mesh_lib.my_flat_index(lay.m)
    ids_R = replicas_lib.to_slots(ids_R, extras["slots"], num_experts, me)
  copies = 1
  if esp is not None:  # the Dump: each row to the GPUs holding its slot's d_ff slices
    ids_R, copies = esp_lib.dump(ids_R, lay.slots, lay.m, esp)
    x_RxD = jnp.repeat(x_RxD, copies, axis=0)

  # plan, exchange, experts, exchange back: in the configured schedule.
  exchange = schedule_lib.Exchange(lay.hops, {NODE: lay.n, GPU: lay.m}, lay.slots, lay.kind,
                                   transport_lib.buffer_bound(cfg.buffer_factor, x_RxD.shape[0]))
  local = schedule_lib.Experts(params["w_in"], params["w_out"], params.get("w_gate"), cfg.activation,
                               cfg.expert_backend, jnp.dtype(cfg.dtype),
                               partial_sum_over=GPU if esp == "baseline" else None)
  result = schedule_lib.run(cfg.schedule, x_RxD, ids_R, exchange, local, cfg.num_chunks)
  # A choice counts as processed only if every copy arrived (a partial sum of slices is no output).
  arrived_R = result.arrived_R.reshape(-1, copies).all(axis=1)
  y_RxD = jnp.where(arrived_R[:, None], result.y_RxD.reshape(-1, copies, d).sum(axis=1), 0.0)
  if esp == "baseline":  # the copy of this GPU's own tokens (all copies are equal)
    y_RxD, arrived_R, logical_R = y_RxD[:tokens * k], arrived_R[:tokens * k], logical_R[:tokens * k]
  processed_R = jnp.where(arrived_R, logical_R, -1)
  overflowed = jnp.sum((logical_R >= 0) & ~arrived_R, dtype=jnp.int32)
  if esp == "s2":  # every GPU's outputs of the dispatched tensor, back in token-choice order
    y_RxD = esp_lib.undispatch(esp_lib.mp_all_gather(y_RxD.astype(x_TxD.dtype)), slot_R)

  # combine: the weighted sum over each token's choices.
  weights_TxK = jnp.where(keep_TxK, decision.weights, 0.0)
  y_TxD = jnp.einsum("tk,tkd->td", weights_TxK, y_RxD.reshape(tokens, k, d).astype(jnp.float32))
  y_TxD = y_TxD.astype(x_TxD.dtype)
  routed_TxK = decision.expert_ids
  if esp == "s1":  # every GPU's tokens of the node
    y_TxD, routed_TxK = esp_lib.mp_all_gather(y_TxD), esp_lib.mp_all_gather(routed_TxK)
  if shared_TxD is not None:
    y_TxD = y_TxD + shared_TxD.astype(y_TxD.dtype)

  stats = jax.lax.psum(stats, lay.routed_over)
  aux = routing.aux_losses(stats, cfg, extras.get("balance_counts"))
  if "balance_counts" in extras:
    aux["balance_counts"] = extras["balance_counts"] + routing.balance_counts(stats, cfg)
  aux["expert_counts"] = jax.lax.psum(plan_lib.histogram(processed_R, num_experts), lay.sent_over)
  aux["tokens_dropped"] = jax.lax.psum(jnp.sum(~keep_TxK, dtype=jnp.int32), lay.routed_over)
  aux["tokens_overflowed"] = jax.lax.psum(overflowed, lay.sent_over)
  aux["traffic_rows"] = jnp.stack(hop_traffic(result.routes, lay))
  aux["expert_ids"] = routed_TxK
  return y_TxD, aux
