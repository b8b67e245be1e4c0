"""The expert-parallel MoE layer: `moe_apply` (functional core) and `MoELayer` (Flax nnx module).

Inside `jax.shard_map` over the ('node', 'gpu') mesh each device routes its own tokens, sends each
token-choice to the device holding its expert, runs its local experts on what it received, sends
the results back and combines them with the router weights (README.md, "What moejax is").
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import expert_sharding as esp_lib
from moejax.moe import experts as experts_lib
from moejax.moe import plan as plan_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe import routing
from moejax.moe import schedule as schedule_lib
from moejax.moe import transport as transport_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import ConfigError, require

ALL = mesh_lib.AXES  # Both mesh axes as one: the flat device index.
NODE, GPU = mesh_lib.NODE, mesh_lib.GPU
# aux entries that are totals over the mesh (replicated); expert_ids is sharded like the tokens.
AUX_TOTALS = ("load_balance_loss", "z_loss", "aux_loss", "expert_counts", "tokens_dropped", "tokens_overflowed",
              "traffic_rows")


def param_shapes(cfg: MoEConfig) -> dict:
  """The public parameter layout: name -> shape (checkpoints and other frameworks rely on it)."""
  e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
  shapes = {name: {"kernel": (d, width)} for name, width in routing.router_widths(cfg).items()}
  shapes.update({"w_in": (e, d, f), "w_out": (e, f, d)})
  if cfg.gated:
    shapes["w_gate"] = (e, d, f)
  if cfg.num_shared_experts:
    w = cfg.shared_width
    shapes["shared"] = {"w_in": (d, w), "w_out": (w, d), **({"w_gate": (d, w)} if cfg.gated else {})}
  if cfg.shared_gate:
    shapes["shared_gate"] = {"kernel": (d, 1)}
  return shapes


def param_specs(cfg: MoEConfig) -> dict:
  """Routers replicated; experts sharded over both mesh axes on the expert dimension, or with
  expert sharding over 'node' on the expert dimension and over 'gpu' on d_ff."""
  specs = {name: {"kernel": P()} for name in routing.router_names(cfg)}
  if cfg.num_shared_experts:  # replicated, or with expert sharding split over 'gpu' like the dense FFN
    split = cfg.esp_schedule is not None
    specs["shared"] = {"w_in": P(None, GPU) if split else P(), "w_out": P(GPU, None) if split else P(),
                       **({"w_gate": P(None, GPU) if split else P()} if cfg.gated else {})}
  if cfg.shared_gate:
    specs["shared_gate"] = {"kernel": P()}
  if cfg.esp_schedule is None:
    specs.update({"w_in": P(ALL), "w_out": P(ALL)}, **({"w_gate": P(ALL)} if cfg.gated else {}))
  else:
    specs.update({"w_in": P(NODE, None, GPU), "w_out": P(NODE, GPU, None)},
                 **({"w_gate": P(NODE, None, GPU)} if cfg.gated else {}))
  return specs


def init_params(rng: jax.Array, cfg: MoEConfig, dtype=jnp.float32) -> dict:
  """Fresh parameters with fan-in scaled normal initialisation."""
  shapes = param_shapes(cfg)
  keys = dict(zip(["w_in", "w_out", "w_gate", *routing.router_names(cfg)], jax.random.split(rng, 5)))
  normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, dtype) / jnp.sqrt(fan_in)).astype(dtype)
  params = {}
  for i, (name, shape) in enumerate(shapes.items()):
    key = keys.get(name, jax.random.fold_in(rng, 100 + i))
    if not isinstance(shape, dict):  # expert weights [E, fan_in, ...]
      params[name] = normal(key, shape, shape[1])
    else:  # a group of matrices [fan_in, ...]
      subkeys = [key] if len(shape) == 1 else jax.random.split(key, len(shape))
      params[name] = {k: normal(sk, sub, sub[0]) for sk, (k, sub) in zip(subkeys, shape.items())}
  return params


class Layout(NamedTuple):
  """How one layer call spreads over the mesh, fixed before tracing (`layout`).

  holders: where expert slots live: D devices, or n nodes with expert sharding (each slot's d_ff split
    over the node's GPUs); slots: Z, expert slots per holder (E / holders, or a slot table's width);
  tokens: the tokens one device routes (one dispatch group: capacity counts within it);
  rows: the token-choice rows one device sends after expert sharding's split or copies, before the Dump;
  copies: rows per token-choice after the Dump (m for s1 / s2, else 1); gathered: the baseline's m copies
    of the node's tokens (else 1); hops: the exchange hops; kind: the exchange kind;
  x_spec: the sharding of x and y; routed_over / sent_over: the mesh axes along which devices route
    different tokens / send different rows (what sums of statistics and counts run over).
  """

  n: int
  m: int
  holders: int
  slots: int
  tokens: int
  rows: int
  copies: int
  gathered: int
  hops: tuple
  kind: transport_lib.Kind
  x_spec: P
  routed_over: tuple
  sent_over: tuple


def layout(cfg: MoEConfig, tokens: int, mesh: jax.sharding.Mesh, slots: int | None = None) -> Layout:
  """The layer's layout for `tokens` global tokens on `mesh`; slots: a slot table's width (None: none).
  Raises ConfigError naming the field where the pieces cannot meet."""
  n, m = mesh_lib.axis_sizes(mesh)
  esp, k = cfg.esp_schedule, cfg.choices_per_token
  require(esp != "auto", "esp_schedule", esp, "a concrete schedule: resolve 'auto' when the config is made "
          "(moejax.moe.expert_sharding.resolve_auto(cfg, tokens, nodes, gpus_per_node); the trainer does)")
  holders = n if esp is not None else n * m
  per_holder = cfg.check_mesh(n, m)
  slots = per_holder if slots is None else slots
  if esp is None:
    local = tokens // (n * m)
    routed, sent, x_spec, route_tokens, rows, copies, gathered = ALL, ALL, P(ALL), local, local * k, 1, 1
  else:
    local = tokens // n
    x_spec, gathered, copies = P(NODE), (m if esp == "baseline" else 1), (1 if esp == "baseline" else m)
    route_tokens = local // m if esp == "s1" else local
    routed = ALL if esp == "s1" else (NODE,)
    sent = (NODE,) if esp == "baseline" else ALL
    rows = {"baseline": m * local * k, "s1": route_tokens * k, "s2": -(-local * k // m)}[esp]
    if esp == "s2" and cfg.capacity_factor is not None:  # the slot buffer [E, C'] split on its capacity axis
      rows = cfg.num_experts * s2_capacity(cfg, route_tokens, m) // m
  hops = transport_lib.transport_hops(cfg.transport)
  if esp == "baseline":
    require(hops == transport_lib.FLAT_HOPS, "transport", cfg.transport,
            "a one-hop transport with esp_schedule='baseline': its exchange runs over 'node' alone (each GPU to "
            "the same GPU index of the expert's node, whose ESP all-reduce needs every GPU of a node to hold the "
            "same rows), so there is no intra-node hop for a two-hop transport to take")
    hops = (NODE,)
  kind = platform_lib.exchange_kind(cfg.transport, platform_lib.of_mesh(mesh))
  if kind == transport_lib.DENSE:  # a block per peer: every slot of the peer full, for each copy
    per_slot = routing.expert_capacity(cfg, route_tokens) * gathered
    if esp == "s2":
      per_slot = s2_capacity(cfg, route_tokens, m) // m
    kind = transport_lib.Kind(kind, slots * per_slot)
  return Layout(n, m, holders, slots, route_tokens, rows, copies, gathered, hops, transport_lib.as_kind(kind),
                x_spec, routed, sent)


def s2_capacity(cfg: MoEConfig, tokens: int, gpus_per_node: int) -> int:
  """S2's capacity C padded to a multiple of m, so that the slot buffer [E, C'] splits evenly over the
  node's GPUs (padding slots stay empty)."""
  capacity = routing.expert_capacity(cfg, tokens)
  return -(-capacity // gpus_per_node) * gpus_per_node


def check_inputs(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, slot_expert=None,
                 expert_bias=None, balance_counts=None) -> Layout:
  """Validates shapes and choices before tracing; returns the layout."""
  n, m = mesh_lib.axis_sizes(mesh)
  cfg.check_mesh(n, m)
  slots = None
  if slot_expert is not None:
    holders = n if cfg.esp_schedule is not None else n * m
    slots = replicas_lib.check_slot_table(slot_expert, cfg.num_experts, holders,
                                          "nodes" if cfg.esp_schedule is not None else "devices")
  if not isinstance(params, dict):
    raise ConfigError(f"params must be a dict in the documented layout, got {type(params).__name__}")
  want = param_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if got != want:
    raise ConfigError(f"parameter shapes {got} do not match the layout for this config: {want}")
  if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
    raise ConfigError(f"x has shape {x.shape}; expected [tokens, {cfg.d_model}] or [batch, seq, {cfg.d_model}]")
  tokens = x.size // cfg.d_model
  if cfg.esp_schedule is None and tokens % (n * m):
    raise ConfigError(f"x has {tokens} tokens, not a multiple of the mesh's {n * m} devices")
  groups = n * m if cfg.esp_schedule == "s1" else n
  if cfg.esp_schedule is not None and tokens % groups:
    where = "each node's tokens split over its GPUs" if cfg.esp_schedule == "s1" else "tokens sharded over the nodes"
    raise ConfigError(f"x has {tokens} tokens, not a multiple of {groups} (esp_schedule={cfg.esp_schedule!r}: "
                      f"{where})")
  lay = layout(cfg, tokens, mesh, slots)
  if cfg.balance_loss == "sequence":
    require(x.ndim == 3 and lay.tokens % x.shape[1] == 0, "balance_loss", cfg.balance_loss,
            f"'batch' unless x is [batch, seq, d] with whole sequences on each routing device (x {x.shape}, "
            f"{lay.tokens} tokens routed per device)")
  if expert_bias is not None and tuple(np.shape(expert_bias)) != (cfg.num_experts,):
    raise ConfigError(f"expert_bias has shape {tuple(np.shape(expert_bias))}; expected [{cfg.num_experts}]",
                      "expert_bias", tuple(np.shape(expert_bias)), f"[{cfg.num_experts}]")
  if balance_counts is not None:
    require(cfg.balance_loss == "global_batch", "balance_counts", "given",
            f"None unless balance_loss='global_batch' (it is {cfg.balance_loss!r})")
    require(tuple(np.shape(balance_counts)) == (cfg.balance_counts_size,), "balance_counts",
            tuple(np.shape(balance_counts)), f"[{cfg.balance_counts_size}] (cfg.balance_counts_size)")
  if cfg.schedule == "chunked" and lay.rows % cfg.num_chunks:
    raise ConfigError(f"num_chunks={cfg.num_chunks} does not divide the {lay.rows} token-choice rows each device "
                      f"sends (schedule='chunked' splits them into equal chunks)", "num_chunks", cfg.num_chunks,
                      f"a divisor of {lay.rows}")
  platform = platform_lib.of_mesh(mesh)
  platform_lib.check_transport(cfg.transport, platform)
  require(cfg.esp_schedule is None or platform_lib.check_vma(cfg.expert_backend, platform),
          "expert_backend", cfg.expert_backend,
          f"not 'pallas' with esp_schedule on {platform}: expert sharding's collectives are typed by shard_map's "
          "mesh-axis variance, which the Pallas interpreter cannot give (on GPU the compiled kernels can)")
  return lay


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


def shared_experts(x_TxD, params, cfg: MoEConfig):
  """The shared experts on every token: x [T, d] -> [T, d] fp32 (one dense FFN of the shared width,
  optionally gated by Qwen2-MoE's sigmoid(x w_g)); with expert sharding each GPU holds a d_ff slice and
  the partial outputs are summed over 'gpu', as the dense FFN's are under tensor parallelism."""
  shared, dtype, act = params["shared"], jnp.dtype(cfg.dtype), experts_lib.ACTIVATIONS[cfg.activation]
  mm = lambda a, w: jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  h = act(mm(x_TxD, shared["w_in"])) if not cfg.gated else act(mm(x_TxD, shared["w_gate"])) * mm(x_TxD, shared["w_in"])
  y = mm(h, shared["w_out"])
  if cfg.esp_schedule is not None:
    y = jax.lax.psum(y, GPU)
  if cfg.shared_gate:
    y = jax.nn.sigmoid(x_TxD.astype(jnp.float32) @ params["shared_gate"]["kernel"].astype(jnp.float32)) * y
  return y


def hop_traffic(routes, lay: Layout) -> list:
  """[A, A] kept rows moved between flat devices in each hop, summed over the routes."""
  mine = [jax.lax.axis_index(a) for a in lay.hops]
  return [global_traffic(sum(r.plans[h].kept_AxA[me] for r in routes), a, lay.n, lay.m)
          for h, (a, me) in enumerate(zip(lay.hops, mine))]


def traffic_summary(traffic_rows, gpus_per_node: int, bytes_per_row: int) -> list[dict]:
  """Per hop: rows and bytes that cross nodes (inter) or stay inside one (intra); a device's rows
  to itself move no data and are left out. traffic_rows: [hops, A, A] from `aux`."""
  traffic = np.asarray(traffic_rows, np.int64)
  cross, inside = mesh_lib.pair_masks(traffic.shape[-1], gpus_per_node)
  summary = []
  for hop in traffic:
    inter, intra = int(hop[cross].sum()), int(hop[inside].sum())
    summary.append({"inter_node_rows": inter, "intra_node_rows": intra,
                    "inter_node_bytes": inter * bytes_per_row, "intra_node_bytes": intra * bytes_per_row})
  return summary


def global_traffic(send_A, axis_name, n, m):
  """[A, A] rows sent between flat devices, from each device's sends to its A peers along the axis."""
  me = mesh_lib.my_flat_index(m)
  peers = jnp.asarray(mesh_lib.peer_table(axis_name, n, m))[me]
  return jax.lax.psum(jnp.zeros((n * m, n * m), jnp.int32).at[me, peers].set(send_A), ALL)


class Router(nnx.Module):
  """Holds one router's `kernel [d, width]`, so the module's state paths follow the parameter layout."""

  def __init__(self, kernel: jax.Array):
    self.kernel = nnx.Param(kernel)


class SlotTable(nnx.Variable):
  """The replication slot table [A, Z] of a layer: state, not a parameter (no gradient); the trainer
  re-plans it in place."""


class Shared(nnx.Module):
  """Holds the shared experts' w_in / w_out (/ w_gate), so the state paths follow the parameter layout."""

  def __init__(self, weights: dict):
    self.names = tuple(weights)
    for name, value in weights.items():
      setattr(self, name, nnx.Param(value))

  def params(self) -> dict:
    return {name: getattr(self, name)[...] for name in self.names}


class ExpertBias(nnx.Variable):
  """DeepSeek-V3's balancing bias [E] of a layer: state, not a parameter (no gradient); the trainer
  updates it after every step from the measured loads."""


class BalanceCounts(nnx.Variable):
  """The choice counts of the optimizer step's earlier micro-batches [cfg.balance_counts_size]
  (balance_loss='global_batch'): input state the trainer sets per micro-batch; zeros outside training."""


class MoELayer(nnx.Module):
  """Flax nnx module owning the MoE parameters, each placed with its sharding on `mesh`, and with
  cfg.slots_per_device its slot table (`slot_expert`, a `SlotTable`, replicated), with cfg.bias_update_rate
  its balancing bias (`expert_bias`, an `ExpertBias` [E], replicated), with balance_loss='global_batch' the
  earlier micro-batches' choice counts (`balance_counts`, a `BalanceCounts`, replicated).

  Call with x [tokens, d] or [batch, seq, d]; returns (y, aux) as `moe_apply`.
  """

  def __init__(self, cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs, dtype=jnp.float32):
    self.cfg, self.mesh = cfg, mesh
    cfg.check_mesh(*mesh_lib.axis_sizes(mesh))
    params = init_params(rngs.params(), cfg, dtype)
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    params = jax.tree.map(place, params, param_specs(cfg))
    for name in routing.router_names(cfg):
      setattr(self, name, Router(params[name]["kernel"]))
    self.w_in = nnx.Param(params["w_in"])
    self.w_out = nnx.Param(params["w_out"])
    self.w_gate = nnx.Param(params["w_gate"]) if cfg.gated else None
    self.shared = Shared(params["shared"]) if cfg.num_shared_experts else None
    self.shared_gate = Router(params["shared_gate"]["kernel"]) if cfg.shared_gate else None
    table = None
    if cfg.slots_per_device is not None:
      table = replicas_lib.initial_table(cfg.num_experts, cfg.expert_holders(*mesh_lib.axis_sizes(mesh)),
                                         cfg.slots_per_device)
    # One assignment: nnx fixes an attribute's kind (data or static) when it is first set.
    self.slot_expert = None if table is None else SlotTable(jax.device_put(jnp.asarray(table), NamedSharding(mesh, P())))
    self.expert_bias = None if cfg.bias_update_rate == 0 else ExpertBias(
        jax.device_put(jnp.zeros((cfg.num_experts,), jnp.float32), NamedSharding(mesh, P())))
    self.balance_counts = None if cfg.balance_loss != "global_batch" else BalanceCounts(
        jax.device_put(jnp.zeros((cfg.balance_counts_size,), jnp.float32), NamedSharding(mesh, P())))
    self.rngs = rngs

  def params(self) -> dict:
    """The parameters as a plain dict in the public layout."""
    params = {name: {"kernel": getattr(self, name).kernel[...]} for name in routing.router_names(self.cfg)}
    params.update({"w_in": self.w_in[...], "w_out": self.w_out[...]})
    if self.w_gate is not None:
      params["w_gate"] = self.w_gate[...]
    if self.shared is not None:
      params["shared"] = self.shared.params()
    if self.shared_gate is not None:
      params["shared_gate"] = {"kernel": self.shared_gate.kernel[...]}
    return params

  def __call__(self, x: jax.Array, *, train: bool = False, rng: jax.Array | None = None,
               slot_expert: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """rng: the key of the router jitter in training; None draws it from the layer's own `rngs`.
    slot_expert: a replication slot table [A, Z] (see `moe_apply`); default the layer's own, if any."""
    if rng is None and train and self.cfg.jitter > 0:
      rng = self.rngs.jitter()
    if slot_expert is None and self.slot_expert is not None:
      slot_expert = self.slot_expert[...]
    bias = None if self.expert_bias is None else self.expert_bias[...]
    prior = None if self.balance_counts is None else self.balance_counts[...]
    return moe_apply(self.params(), x, self.cfg, self.mesh, rng=rng, train=train, slot_expert=slot_expert,
                     expert_bias=bias, balance_counts=prior)
