"""The expert-parallel MoE layer: `moe_apply` (functional core) and `MoELayer` (Flax nnx module).

Inside `jax.shard_map` over the ('node', 'gpu') mesh each device routes its own tokens, sends each
token-choice to the device holding its expert, runs its local experts on what it received, sends
the results back and combines them with the router weights (README.md, "What moejax is").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import esp as esp_lib
from moejax.moe import plan as plan_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe import routing
from moejax.moe import schedule as schedule_lib
from moejax.moe import transport as transport_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import ConfigError

ALL = mesh_lib.AXES  # Both mesh axes as one: the flat device index.


def param_shapes(cfg: MoEConfig) -> dict:
  """The public parameter layout: name -> shape (checkpoints and other frameworks rely on it)."""
  e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
  shapes = {name: {"kernel": (d, width)} for name, width in routing.router_widths(cfg).items()}
  shapes.update({"w_in": (e, d, f), "w_out": (e, f, d)})
  if cfg.gated:
    shapes["w_gate"] = (e, d, f)
  return shapes


def param_specs(cfg: MoEConfig) -> dict:
  """Routers replicated; experts sharded over both mesh axes on the expert dimension (with
  esp_schedule: over 'node' on the expert dimension and over 'gpu' on d_ff, `esp.param_specs`)."""
  if cfg.esp_schedule is not None:
    return esp_lib.param_specs(cfg)
  specs = {name: {"kernel": P()} for name in routing.router_names(cfg)}
  specs.update({"w_in": P(ALL), "w_out": P(ALL)})
  if cfg.gated:
    specs["w_gate"] = P(ALL)
  return specs


def init_params(rng: jax.Array, cfg: MoEConfig, dtype=jnp.float32) -> dict:
  """Fresh parameters with fan-in scaled normal initialisation."""
  shapes = param_shapes(cfg)
  keys = dict(zip(["w_in", "w_out", "w_gate", *routing.router_names(cfg)], jax.random.split(rng, 5)))
  normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, dtype) / jnp.sqrt(fan_in)).astype(dtype)
  return {name: {"kernel": normal(keys[name], shape["kernel"], cfg.d_model)} if isinstance(shape, dict)
          else normal(keys[name], shape, shape[1]) for name, shape in shapes.items()}


def check_inputs(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, slot_expert=None) -> int:
  """Validates shapes and choices before tracing; returns the experts (or slots) per device."""
  n, m = mesh_lib.axis_sizes(mesh)
  if slot_expert is None:
    experts_per_gpu = cfg.check_mesh(n, m)
  else:
    experts_per_gpu = replicas_lib.check_slot_table(slot_expert, cfg.num_experts, n * m)
    if cfg.transport == "capacity":
      raise ConfigError("a slot table needs a ragged transport, not transport='capacity' (whose dense "
                        "dispatch has one capacity block per logical expert)", "transport", cfg.transport)
  if not isinstance(params, dict):
    raise ConfigError(f"params must be a dict in the documented layout, got {type(params).__name__}")
  want = param_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if got != want:
    raise ConfigError(f"parameter shapes {got} do not match the layout for this config: {want}")
  if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
    raise ConfigError(f"x has shape {x.shape}; expected [tokens, {cfg.d_model}] or [batch, seq, {cfg.d_model}]")
  tokens = x.size // cfg.d_model
  if tokens % (n * m):
    raise ConfigError(f"x has {tokens} tokens, not a multiple of the mesh's {n * m} devices")
  local_tokens = tokens // (n * m)
  if cfg.schedule == "chunked" and local_tokens % cfg.num_chunks:
    raise ConfigError(f"num_chunks={cfg.num_chunks} does not divide the {local_tokens} tokens per device "
                      f"(schedule='chunked' splits them into equal chunks)", "num_chunks", cfg.num_chunks,
                      f"a divisor of {local_tokens}")
  platform_lib.check_transport(cfg.transport, platform_lib.of_mesh(mesh))
  return experts_per_gpu


def moe_apply(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, *,
              rng: jax.Array | None = None, train: bool = False, slot_expert: jax.Array | None = None
              ) -> tuple[jax.Array, dict]:
  """The MoE layer: x [tokens, d] or [batch, seq, d], sharded over both mesh axes -> (y like x, aux).

  aux: load_balance_loss, z_loss, aux_loss (their sum; add it to the training loss), expert_counts
  [E] (token-choices each expert processed), tokens_dropped (token-choices dropped by capacity),
  tokens_overflowed (token-choices dropped because a receive buffer was full; see buffer_factor),
  traffic_rows [hops, D, D] (rows sent from flat device s to flat device p in each exchange hop, hops
  in the order of `transport.transport_hops(cfg.transport)`; `traffic_summary` splits them into inter- and intra-node traffic).
  rng: needed only for router jitter when train=True and cfg.jitter > 0.
  slot_expert: optional [D, S] int, the logical expert of each physical slot (Lina's replication;
    `moejax.replication.rebalance`): the experts run as copies in those slots (`moe.replicas`), with
    the same result; expert_counts stay per logical expert.
  With cfg.esp_schedule set, the layer is Parm's expert-sharded one (`moe.esp`): x and y sharded over
  'node' and replicated over 'gpu'.
  """
  if cfg.esp_schedule is not None:
    if slot_expert is not None:
      raise ConfigError("slot_expert (replicated experts) and esp_schedule (expert sharding) do not combine",
                        "esp_schedule", cfg.esp_schedule)
    schedule = esp_lib.resolve_schedule(cfg, x.size // cfg.d_model, mesh)
    return esp_lib.esp_apply(params, x, cfg, mesh, schedule=schedule, rng=rng, train=train)
  check_inputs(params, x, cfg, mesh, slot_expert)  # here too: a concrete slot table's contents are checked
  return _moe_apply(params, x, cfg, mesh, rng=rng, train=train, slot_expert=slot_expert)


# Jitted so that eager calls (notebooks, MoELayer outside jit) compile once instead of running
# shard_map op by op; inside an outer jit it is inlined.
@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "train"))
def _moe_apply(params, x, cfg, mesh, *, rng, train, slot_expert):
  experts_per_gpu = check_inputs(params, x, cfg, mesh, slot_expert)
  n, m = mesh_lib.axis_sizes(mesh)
  x_TxD = x.reshape(-1, cfg.d_model)
  extras, extra_specs = {}, {}
  if slot_expert is not None:
    params = replicas_lib.physical_params(params, slot_expert)
    extras["slots"], extra_specs["slots"] = jnp.asarray(slot_expert, jnp.int32).reshape(-1), P()
  if train and cfg.jitter > 0:
    if rng is None:
      raise ConfigError(f"jitter={cfg.jitter} in training needs an rng")
    extras["noise"] = jax.random.uniform(rng, x_TxD.shape, jnp.float32, 1 - cfg.jitter, 1 + cfg.jitter)
    extra_specs["noise"] = P(ALL)
  args, in_specs = [x_TxD, params, extras], [P(ALL), param_specs(cfg), extra_specs]
  platform = platform_lib.of_mesh(mesh)
  body = functools.partial(_moe_local, cfg=cfg, n=n, m=m, experts_per_gpu=experts_per_gpu,
                           kind=platform_lib.exchange_kind(cfg.transport, platform))
  y_TxD, aux = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=(P(ALL), P()),
                             check_vma=platform_lib.check_vma(cfg.expert_backend, platform))(*args)
  return y_TxD.reshape(x.shape), aux


def _moe_local(x_TxD, params, extras, *, cfg: MoEConfig, n: int, m: int, experts_per_gpu: int, kind: str):
  """One device's part of the layer: x [T, d] local tokens -> (y [T, d], aux); extras: the router
  noise [T, d] (jitter) and the flat slot table [D * S] (replication), when used."""
  tokens, d = x_TxD.shape
  k, num_experts = cfg.choices_per_token, cfg.num_experts
  router_in = x_TxD * extras["noise"] if "noise" in extras else x_TxD
  decision, stats = routing.route(router_in, params, cfg)
  ids_TxK = decision.expert_ids
  if cfg.capacity_factor is None:
    keep_TxK = jnp.ones_like(ids_TxK, bool)
  else:
    capacity = routing.expert_capacity(cfg, tokens)
    positions_TxK = routing.queue_positions(ids_TxK, num_experts)
    keep_TxK = positions_TxK < capacity
  kept_ids_R = jnp.where(keep_TxK, ids_TxK, -1).reshape(-1)  # token-major (token, choice) pairs
  x_RxD = jnp.repeat(x_TxD, k, axis=0)
  local = schedule_lib.Experts(params["w_in"], params["w_out"], params.get("w_gate"), cfg.activation,
                               cfg.expert_backend, jnp.dtype(cfg.dtype))

  if cfg.transport == "capacity":
    slots_R = jnp.where(keep_TxK, ids_TxK * capacity + positions_TxK, -1).reshape(-1)
    blocks = transport_lib.capacity_dispatch(x_RxD, slots_R, num_experts * capacity, ALL, n * m)
    y_blocks = capacity_experts(blocks, experts_per_gpu, local.ffn)
    y_RxD = transport_lib.capacity_combine(y_blocks, slots_R, ALL)
    traffic = [global_traffic(_sends_per_device(kept_ids_R, experts_per_gpu, n * m), ALL, n, m)]
    processed_ids_R, overflowed = kept_ids_R, jnp.zeros((), jnp.int32)
  else:
    hops = transport_lib.transport_hops(cfg.transport)
    exchange = schedule_lib.Exchange(hops, {mesh_lib.NODE: n, mesh_lib.GPU: m}, experts_per_gpu, kind,
                                     transport_lib.buffer_bound(cfg.buffer_factor, tokens * k))
    send_ids_R = kept_ids_R
    if "slots" in extras:  # to one replica of each row's expert
      send_ids_R = replicas_lib.to_slots(kept_ids_R, extras["slots"], num_experts, mesh_lib.my_flat_index(m))
    result = schedule_lib.run(cfg.schedule, x_RxD, send_ids_R, exchange, local, cfg.num_chunks)
    y_RxD, processed_ids_R = result.y_RxD, result.processed_ids
    if "slots" in extras:
      processed_ids_R = replicas_lib.to_experts(processed_ids_R, extras["slots"])
    mine = [jax.lax.axis_index(a) for a in hops]
    traffic = [global_traffic(sum(r.plans[h].kept_AxA[me] for r in result.routes), a, n, m)
               for h, (a, me) in enumerate(zip(hops, mine))]
    overflowed = sum(jnp.sum(r.plans[h].sizes_AxA[me] - r.plans[h].kept_AxA[me])
                     for r in result.overflow_routes for h, me in enumerate(mine))

  weights_TxK = jnp.where(keep_TxK, decision.weights, 0.0)
  y_TxD = jnp.einsum("tk,tkd->td", weights_TxK, y_RxD.reshape(tokens, k, d).astype(jnp.float32))
  aux = routing.aux_losses(jax.lax.psum(stats, ALL), cfg)
  aux["expert_counts"] = jax.lax.psum(plan_lib.histogram(processed_ids_R, num_experts), ALL)
  aux["tokens_dropped"] = jax.lax.psum(jnp.sum(~keep_TxK, dtype=jnp.int32), ALL)
  aux["tokens_overflowed"] = jax.lax.psum(overflowed.astype(jnp.int32), ALL)
  aux["traffic_rows"] = jnp.stack(traffic)
  return y_TxD.astype(x_TxD.dtype), aux


def traffic_summary(traffic_rows, gpus_per_node: int, bytes_per_row: int) -> list[dict]:
  """Per hop: rows and bytes that cross nodes (inter) or stay inside one (intra); a device's rows
  to itself move no data and are left out. traffic_rows: [hops, D, D] from `aux`."""
  traffic = np.asarray(traffic_rows, np.int64)
  node = mesh_lib.node_of(np.arange(traffic.shape[-1]), gpus_per_node)
  crosses = node[:, None] != node[None, :]
  itself = np.eye(traffic.shape[-1], dtype=bool)
  summary = []
  for hop in traffic:
    inter, intra = int(hop[crosses].sum()), int(hop[~crosses & ~itself].sum())
    summary.append({"inter_node_rows": inter, "intra_node_rows": intra,
                    "inter_node_bytes": inter * bytes_per_row, "intra_node_bytes": intra * bytes_per_row})
  return summary


def capacity_experts(blocks, groups: int, ffn):
  """blocks [A(src), G * C, d] (expert-major slots) -> ffn(rows, group_sizes) in the same layout, every
  slot computed; ffn: rows [R, d] grouped by local expert, group sizes [G] -> [R, d]."""
  num_src, slots, d = blocks.shape
  rows = blocks.reshape(num_src, groups, slots // groups, d).transpose(1, 0, 2, 3)
  group_sizes = jnp.full((groups,), num_src * slots // groups, jnp.int32)
  y = ffn(rows.reshape(-1, d), group_sizes).astype(blocks.dtype)
  return y.reshape(rows.shape).transpose(1, 0, 2, 3).reshape(blocks.shape)


def _sends_per_device(ids_R, experts_per_gpu, num_devices):
  return plan_lib.histogram(jnp.where(ids_R >= 0, ids_R // experts_per_gpu, -1), num_devices)


def global_traffic(send_A, axis_name, n, m):
  """[D, D] rows sent between flat devices, from each device's sends to its A peers along the axis."""
  me = mesh_lib.my_flat_index(m)
  peers = jnp.asarray(mesh_lib.peer_table(axis_name, n, m))[me]
  return jax.lax.psum(jnp.zeros((n * m, n * m), jnp.int32).at[me, peers].set(send_A), ALL)


class Router(nnx.Module):
  """Holds one router's `kernel [d, width]`, so the module's state paths follow the parameter layout."""

  def __init__(self, kernel: jax.Array):
    self.kernel = nnx.Param(kernel)


class MoELayer(nnx.Module):
  """Flax nnx module owning the MoE parameters, each placed with its sharding on `mesh`.

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
    self.rngs = rngs

  def params(self) -> dict:
    """The parameters as a plain dict in the public layout."""
    params = {name: {"kernel": getattr(self, name).kernel[...]} for name in routing.router_names(self.cfg)}
    params.update({"w_in": self.w_in[...], "w_out": self.w_out[...]})
    if self.w_gate is not None:
      params["w_gate"] = self.w_gate[...]
    return params

  def __call__(self, x: jax.Array, *, train: bool = False, rng: jax.Array | None = None,
               slot_expert: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """rng: the key of the router jitter in training; None draws it from the layer's own `rngs`.
    slot_expert: optional [D, S] replication slot table (see `moe_apply`)."""
    if rng is None and train and self.cfg.jitter > 0:
      rng = self.rngs.jitter()
    return moe_apply(self.params(), x, self.cfg, self.mesh, rng=rng, train=train, slot_expert=slot_expert)
