"""Parm's expert-sharding layer: experts over 'node' (EP), each expert's d_ff over 'gpu' (ESP = MP).

Parm (arXiv 2407.00599; digest Sec. 2-5, 10) in the special case ESP = MP of DeepSpeed-TED: the layer
input x [tokens, d] is sharded over 'node' and replicated over the m GPUs of a node (the MP group, as
Megatron tensor parallelism of the dense parts leaves it); y comes back the same way. Expert e lives on
node e // (E / n); GPU j of that node holds hidden slice j of width f / m (columns of w_in / w_gate, rows
of w_out), so an expert output is the sum of its m slices' partial outputs (the activation is elementwise
in f). Schedules, with each collective's per-device size in the paper's notation (BLM = the node's
tokens, ETM = the node's dispatched tensor [E, T, d] of capacity T):

  baseline (DeepSpeed-MoE, Parm Sec. IV-A): ESP all-gather of x (BLM in, BLM x N_ESP out), gate, EP
    all-to-all (ETM x N_ESP), expert slice, ESP all-reduce (ETM x N_ESP), EP all-to-all, ESP split.
    Every token is computed N_MP times.
  s1 (PauseMP before the gate): MP split of x, gate on BL / N_MP tokens, Dump, one all-to-all over
    EP x ESP (ETM x N_ESP / N_MP), expert slice, the reverse all-to-all, local combine (sum of the
    slices), gate combine, MP all-gather of y (BLM).
  s2 (PauseMP after the gate): gate on x, MP split of the dispatched tensor, Dump, all-to-all, expert
    slice, all-to-all, local combine, MP all-gather of the expert outputs (ETM), gate combine.

`mp_split` is a split whose backward is an MP all-gather (Parm Sec. III-B); the MP all-gathers are
invariant gathers whose backward is a local slice. In the baseline the ESP all-gather's copies are
identical, so its backward sums the slices' input gradients with all-reduces over 'gpu'.

Exchanges. transport='capacity': GShard dense dispatch into [E, C, d] buffers and fixed-size
all-to-alls; S2 splits the buffer on its capacity axis, padded to a multiple of N_MP (padding slots
stay empty). transport='padded' / 'ragged': the kept token-choices move through `transport.dispatch` /
`combine` (one hop: both axes for S1/S2 with the Dump as m copies of each row, 'node' for the baseline);
S2 splits the token-choice rows. Receive buffers hold ceil(buffer_factor x rows sent); a choice with a
copy that did not fit outputs zero and is counted in tokens_overflowed.

Capacity: each schedule gates a different group of tokens, so its capacity C = ceil(capacity_factor *
group_tokens * K / E) and its drops differ (Parm does not discuss this):
  baseline: the N_ESP gathered copies of the node's tokens, each copy its own dispatch group (T x N_ESP
    rows per expert, Eq. 1), so every copy keeps the same choices and the MP replicas of y agree; the
    kept set is the node's: `reference.moe_reference(num_groups=n)`.
  s2: the node's tokens, one group: the same kept set as the baseline (num_groups=n).
  s1: each GPU's tokens / (n m), one group per GPU: `moe_reference(num_groups=n * m)`. With drops S1
    keeps a different set (queues per GPU instead of per node).
"""

import dataclasses
import functools
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.cost import parm
from moejax.cost import topology as topology_lib
from moejax.moe import experts, layer, routing, schedule
from moejax.moe import plan as plan_lib
from moejax.moe import transport as transport_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import ConfigError, require

NODE, GPU, ALL = mesh_lib.NODE, mesh_lib.GPU, mesh_lib.AXES
SCHEDULES = ("baseline", "s1", "s2")
TRANSPORTS = ("capacity", "padded", "ragged")


def param_specs(cfg: MoEConfig) -> dict:
  """Routers replicated; experts over 'node' on the expert dimension and over 'gpu' on d_ff."""
  specs = {name: {"kernel": P()} for name in routing.router_names(cfg)}
  specs.update({"w_in": P(NODE, None, GPU), "w_out": P(NODE, GPU, None)})
  if cfg.gated:
    specs["w_gate"] = P(NODE, None, GPU)
  return specs


def check_inputs(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, schedule: str) -> None:
  """Validates the schedule, config, mesh and shapes before tracing; errors name the field."""
  require(schedule in SCHEDULES, "esp_schedule", schedule, f"one of {SCHEDULES} ('auto' is resolved before)")
  n, m = mesh_lib.axis_sizes(mesh)
  # The expert-sharding rules of the mesh, also when called with a schedule on a config without one.
  dataclasses.replace(cfg, esp_schedule=schedule).check_mesh(n, m)
  require(cfg.transport in TRANSPORTS, "transport", cfg.transport,
          f"one of {TRANSPORTS} when esp_schedule is set (each exchange is one hop)")
  platform_lib.check_transport(cfg.transport, platform_lib.of_mesh(mesh))
  require(cfg.expert_backend != "pallas", "expert_backend", cfg.expert_backend,
          "'ragged_dot' or 'dense' when esp_schedule is set (the schedules rely on shard_map's varying-axes "
          "types, which the Pallas interpreter cannot give)")
  want = layer.param_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params) if isinstance(params, dict) else type(params).__name__
  if got != want:
    raise ConfigError(f"parameter shapes {got} do not match the layout for this config: {want}")
  if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
    raise ConfigError(f"x has shape {x.shape}; expected [tokens, {cfg.d_model}] or [batch, seq, {cfg.d_model}]")
  tokens, groups = x.size // cfg.d_model, n * m if schedule == "s1" else n
  if tokens % groups:
    where = "each node's tokens split over its GPUs" if schedule == "s1" else "tokens sharded over the nodes"
    raise ConfigError(f"x has {tokens} tokens, not a multiple of {groups} (esp_schedule={schedule!r}: {where})")


def resolve_schedule(cfg: MoEConfig, tokens: int, mesh: jax.sharding.Mesh) -> str:
  """cfg.esp_schedule, with 'auto' resolved by Parm's Algorithm 1 (`moejax.cost.parm.choose_schedule`) for
  this layer: EP = n nodes, ESP = MP = m GPUs, B x L = a node's tokens, alpha-beta terms from cfg.esp_cost."""
  if cfg.esp_schedule != "auto":
    return cfg.esp_schedule
  n, m = mesh_lib.axis_sizes(mesh)
  bytes_per_element = jnp.dtype(cfg.dtype).itemsize
  if os.path.exists(cfg.esp_cost):
    with open(cfg.esp_cost) as f:
      terms = parm.alpha_beta_from_bench(json.load(f), bytes_per_element)
  else:
    try:
      preset = topology_lib.get(cfg.esp_cost)
    except ValueError as e:  # names the known presets
      raise ConfigError(f"esp_cost={cfg.esp_cost!r} is neither a file nor a topology preset: {e}", "esp_cost",
                        cfg.esp_cost) from e
    terms = parm.alpha_beta_from_topology(preset, n, m, m, bytes_per_element)
  layer_shape = parm.ParmLayer(B=max(tokens // n, 1), L=1, M=cfg.d_model, H=cfg.d_ff, E=cfg.num_experts,
                               k=cfg.choices_per_token, f=cfg.capacity_factor or 1.0, n_ep=n, n_esp=m, n_mp=m)
  return parm.choose_schedule(layer_shape, terms)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "schedule", "train"))
def esp_apply(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, *, schedule: str,
              rng: jax.Array | None = None, train: bool = False) -> tuple[jax.Array, dict]:
  """The expert-sharded MoE layer: x [tokens, d] or [batch, seq, d] -> (y like x, aux as `layer.moe_apply`).

  x and y are sharded over 'node' and replicated over 'gpu'; parameters as `param_specs`. aux:
  load_balance_loss, z_loss, aux_loss, expert_counts [E] (token-choices each expert processed),
  tokens_dropped (by capacity), tokens_overflowed (by a full receive buffer; 0 with transport='capacity'),
  traffic_rows [1, D, D] (kept token-choices the dispatch exchange moves from flat device s to p, the
  Dump's and the baseline's copies included; the combine mirrors it; the all-gathers and all-reduces are
  read from the program). schedule: 'baseline', 's1' or 's2' (module docstring).
  """
  check_inputs(params, x, cfg, mesh, schedule)
  n, m = mesh_lib.axis_sizes(mesh)
  x_TxD = x.reshape(-1, cfg.d_model)
  args, in_specs = [x_TxD, params], [P(NODE), param_specs(cfg)]
  if train and cfg.jitter > 0:
    if rng is None:
      raise ConfigError(f"jitter={cfg.jitter} in training needs an rng")
    noise = jax.random.uniform(rng, x_TxD.shape, jnp.float32, 1 - cfg.jitter, 1 + cfg.jitter)
    args.append(x_TxD * noise)  # the router's input; the experts get x
    in_specs.append(P(NODE))
  kind = None if cfg.transport == "capacity" else cfg.transport  # dense dispatch, or the ragged exchange
  body = functools.partial(_SCHEDULES[schedule], cfg=cfg, n=n, m=m, kind=kind)
  y_TxD, aux = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=(P(NODE), P()))(*args)
  return y_TxD.reshape(x.shape), aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def mp_split(x, axis: int):
  """MP-Split: this GPU's chunk along `axis` of an array replicated over 'gpu' (no communication).

  The backward all-gathers the chunks' cotangents over 'gpu' (Parm: a split costs an AllGather in
  backpropagation), instead of the all-reduce of zero-padded cotangents that indexing by axis_index
  transposes to.
  """
  return _my_chunk(x, axis)


def _my_chunk(x, axis: int):
  """This GPU's chunk along `axis` of x (no gradient rule of its own: integer arrays, mp_split's forward)."""
  chunk = x.shape[axis] // jax.lax.axis_size(GPU)
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(GPU) * chunk, chunk, axis)


def _mp_split_fwd(x, axis):
  return mp_split(x, axis), None


def _mp_split_bwd(axis, _, grad):
  return (jax.lax.all_gather(grad, GPU, axis=axis, tiled=True, to="invarying"),)


mp_split.defvjp(_mp_split_fwd, _mp_split_bwd)


def mp_all_gather(x, axis: int = 0):
  """MP-AllGather: the chunks of the m GPUs concatenated along `axis`, replicated over 'gpu' (its
  backward is a local slice)."""
  return jax.lax.all_gather(x, GPU, axis=axis, tiled=True, to="invarying")


class Gate(NamedTuple):
  """The routing of G dispatch groups of T tokens each, with GShard capacity per group.

  ids, weights, keep, positions (in the expert's queue): [G, T, K]; slots: [G, T, K] index into an
  expert-major buffer [E, G, padded] (-1 = dropped); stats: the loss sums of each group (leading G).
  """

  ids: jax.Array
  weights: jax.Array
  keep: jax.Array
  positions: jax.Array
  slots: jax.Array
  stats: dict
  padded: int  # the capacity C padded to a multiple of `pad_to`
  num_slots: int  # E * G * padded


def gate(router_in_GxTxD, params, cfg: MoEConfig, pad_to: int = 1) -> Gate:
  """Routes each of the G groups as its own dispatch group of capacity C = `routing.expert_capacity`
  (the dense path's buffer slots; the ragged path moves the kept choices)."""
  groups, tokens, _ = router_in_GxTxD.shape
  decision, stats = jax.vmap(lambda x: routing.route(x, params, cfg))(router_in_GxTxD)
  ids = decision.expert_ids
  # Dropless (capacity_factor None): a capacity of T keeps everything, as a token picks an expert once.
  capacity = tokens if cfg.capacity_factor is None else routing.expert_capacity(cfg, tokens)
  padded = math.ceil(capacity / pad_to) * pad_to
  positions = jax.vmap(lambda ids: routing.queue_positions(ids, cfg.num_experts))(ids)
  keep = positions < capacity
  group = jnp.arange(groups)[:, None, None]
  slots = jnp.where(keep, (ids * groups + group) * padded + positions, -1)
  return Gate(ids, decision.weights, keep, positions, slots, stats, padded, cfg.num_experts * groups * padded)


def _scatter_rows(x_TxD, slots_TxK, num_slots: int):
  """Dense dispatch: each token's row into the buffer slots of its kept choices -> [num_slots, d]."""
  k = slots_TxK.shape[-1]
  slots_R = slots_TxK.reshape(-1)
  buffer = jnp.zeros((num_slots, x_TxD.shape[-1]), x_TxD.dtype)
  return buffer.at[jnp.where(slots_R >= 0, slots_R, num_slots)].set(jnp.repeat(x_TxD, k, axis=0), mode="drop")


def _rows_of_slots(buffer_SxD, slots_TxK):
  """Dense combine: each choice's row of the buffer -> [T, K, d], zero for dropped choices."""
  rows = jnp.take(buffer_SxD, jnp.maximum(slots_TxK, 0), axis=0)
  return jnp.where((slots_TxK >= 0)[..., None], rows, jnp.zeros((), rows.dtype))


def _weighted_sum(y_TxKxD, routed: Gate, group: int = 0):
  """Gate combine: y[t] = sum_k keep * weight * output of choice k -> [T, d] fp32."""
  weights_TxK = jnp.where(routed.keep[group], routed.weights[group], 0.0)
  return jnp.einsum("tk,tkd->td", weights_TxK, y_TxKxD.astype(jnp.float32))


def _slice_ffn(rows_RxD, group_sizes_G, params, cfg: MoEConfig):
  """This GPU's d_ff slice of its node's experts on rows grouped by local expert -> partial outputs [R, d]."""
  return experts.expert_ffn(rows_RxD, group_sizes_G, params["w_in"], params["w_out"], params.get("w_gate"),
                            activation=cfg.activation, backend=cfg.expert_backend,
                            dtype=jnp.dtype(cfg.dtype)).astype(rows_RxD.dtype)


def _slice_on_blocks(blocks_SxRxD, params, cfg: MoEConfig, n: int):
  """Dense: the slice FFN on received blocks [S(source), epn * C, d] (expert-major) -> the same layout."""
  return layer.capacity_experts(blocks_SxRxD, cfg.num_experts // n, lambda r, g: _slice_ffn(r, g, params, cfg))


def _slice_on_rows(rows_RxD, local_R, params, cfg: MoEConfig, n: int):
  """Ragged: the slice FFN on rows in any order, each with its local expert (-1 = empty row -> 0)."""
  epn = cfg.num_experts // n
  return schedule.run_grouped(rows_RxD, jnp.where(local_R >= 0, local_R, epn), epn,
                              lambda r, g: _slice_ffn(r, g, params, cfg))


def _fused_exchange(buffer_SxD, params, cfg: MoEConfig, n: int, m: int):
  """Dense: Dump, EP&ESP all-to-all, expert slice, the reverse all-to-all and the local combine (Parm Sec. III-C).

  buffer [E * C', d] expert-major -> the full expert outputs in the same layout. The Dump sends every
  node's block to each of its m GPUs; the local combine sums the m slices' partial outputs.
  """
  d = buffer_SxD.shape[-1]
  per_node = buffer_SxD.reshape(n, 1, -1, d)
  dumped = jnp.broadcast_to(per_node, (n, m) + per_node.shape[2:]).reshape(n * m, -1, d)
  received = jax.lax.all_to_all(dumped, ALL, 0, 0)  # block s from flat device s
  returned = jax.lax.all_to_all(_slice_on_blocks(received, params, cfg, n), ALL, 0, 0)
  return returned.reshape(n, m, -1, d).sum(axis=1).reshape(buffer_SxD.shape)


def _ragged_exchange(rows_RxD, ids_R, params, cfg: MoEConfig, n: int, m: int, kind: str, *, fused: bool):
  """Dropless: rows (global expert id, -1 = not sent) to the d_ff slices of their experts and back,
  through `transport.dispatch` / `combine`; receive buffers bounded by `cfg.buffer_factor` x the rows sent.

  fused (S1/S2): the Dump (each row to all m GPUs of its expert's node) and one exchange over both axes;
  the returned partial outputs are summed (local combine). Else (baseline): one exchange over 'node' to
  the GPU with the sender's index and an ESP all-reduce of the partial outputs.
  Returns (outputs [R, d], zero where a copy of the row overflowed a buffer; arrived [R]: no copy
  overflowed; traffic [D, D]).
  """
  epn, d = cfg.num_experts // n, rows_RxD.shape[-1]
  copies, hop = (m, ALL) if fused else (1, NODE)
  # Virtual expert ids whose device (id // epn) is the flat device of each copy: GPU j of the node.
  device = (ids_R // epn * m)[:, None] + jnp.arange(copies)[None, :]
  virtual = jnp.where((ids_R >= 0)[:, None], device * epn + ids_R[:, None] % epn, -1).reshape(-1)
  sent = jnp.repeat(rows_RxD, copies, axis=0)  # the Dump
  hops, peers = (hop,), mesh_lib.num_peers(hop, n, m)
  received, received_ids, route = transport_lib.dispatch(
      sent, virtual, hops, {NODE: n, GPU: m}, epn, max_rows=peers * sent.shape[0], kind=kind,
      buffer_rows=transport_lib.buffer_bound(cfg.buffer_factor, sent.shape[0]))
  partial = _slice_on_rows(received, jnp.where(received_ids >= 0, received_ids % epn, -1), params, cfg, n)
  outputs = transport_lib.combine(partial if fused else jax.lax.psum(partial, GPU), route, hops, kind)
  arrived = transport_lib.arrived(received_ids, route, hops, kind).reshape(-1, copies).all(axis=1)
  outputs = jnp.where(arrived[:, None], outputs.reshape(-1, copies, d).sum(axis=1), 0.0).astype(rows_RxD.dtype)
  traffic = layer.global_traffic(route.plans[0].kept_AxA[jax.lax.axis_index(hop)], hop, n, m)
  return outputs, arrived, traffic


def _overflowed(ids_R, arrived_R, num_experts: int):
  """[E] kept token-choices (id >= 0) per expert that overflowed a receive buffer (they output zero)."""
  return plan_lib.histogram(jnp.where(arrived_R, -1, ids_R), num_experts)


def _choice_rows(x_TxD, routed: Gate):
  """Ragged dispatch input: every token-choice's row [G * T * K, d] (groups in order) and its expert,
  -1 if dropped by capacity [G * T * K]."""
  return (jnp.repeat(x_TxD.reshape(-1, x_TxD.shape[-1]), routed.ids.shape[-1], axis=0),
          jnp.where(routed.keep, routed.ids, -1).reshape(-1))


def _baseline(x_TxD, params, router_in=None, *, cfg: MoEConfig, n: int, m: int, kind: str | None):
  """DeepSpeed-MoE: ESP all-gather, EP all-to-all, expert slice, ESP all-reduce, EP all-to-all, ESP split."""
  d, k = x_TxD.shape[-1], cfg.choices_per_token
  gather = functools.partial(jax.lax.all_gather, axis_name=GPU, to="invarying")  # ESP-AllGather
  x_GxTxD = gather(x_TxD)
  routed = gate(x_GxTxD if router_in is None else gather(router_in), params, cfg)
  # ESP-Split: each GPU's own copy of the tokens; all copies are equal (x is replicated and each copy
  # is its own dispatch group), so copy 0 is taken, which keeps y typed as replicated over 'gpu'.
  if kind is None:
    buffer = _scatter_rows(x_GxTxD.reshape(-1, d), routed.slots.reshape(-1, k), routed.num_slots)
    received = jax.lax.all_to_all(buffer.reshape(n, -1, d), NODE, 0, 0)  # EP-AlltoAll
    full = jax.lax.psum(_slice_on_blocks(received, params, cfg, n), GPU)  # ESP-AllReduce
    returned = jax.lax.all_to_all(full, NODE, 0, 0).reshape(-1, d)  # EP-AlltoAll
    y_TxKxD = _rows_of_slots(returned, routed.slots[0])
    overflowed = jnp.zeros((cfg.num_experts,), jnp.int32)
    traffic = _dense_traffic(m * _kept_per_node(routed, cfg, n), NODE, n, m)
  else:
    rows_RxD, ids_R = _choice_rows(x_GxTxD, routed)  # the m copies travel
    outputs, arrived, traffic = _ragged_exchange(rows_RxD, ids_R, params, cfg, n, m, kind,
                                                 fused=False)
    own = slice(0, x_TxD.shape[0] * k)  # copy 0
    y_TxKxD = outputs[own].reshape(-1, k, d)
    overflowed = _overflowed(ids_R[own], arrived[own], cfg.num_experts)
  aux = _aux(routed, NODE, cfg, traffic, jax.lax.psum(overflowed, NODE))
  return _weighted_sum(y_TxKxD, routed).astype(x_TxD.dtype), aux


def _s1(x_TxD, params, router_in=None, *, cfg: MoEConfig, n: int, m: int, kind: str | None):
  """Parm S1: MP split of the tokens, gate, fused exchange, gate combine, MP all-gather of y (BLM)."""
  d, k = x_TxD.shape[-1], cfg.choices_per_token
  x_mine = mp_split(x_TxD, 0)
  routed = gate((x_mine if router_in is None else mp_split(router_in, 0))[None], params, cfg)
  if kind is None:
    buffer = _scatter_rows(x_mine, routed.slots[0], routed.num_slots)
    y_TxKxD = _rows_of_slots(_fused_exchange(buffer, params, cfg, n, m), routed.slots[0])
    overflowed = jnp.zeros((cfg.num_experts,), jnp.int32)
    traffic = _dense_traffic(_kept_per_node(routed, cfg, n), ALL, n, m)
  else:
    rows_RxD, ids_R = _choice_rows(x_mine, routed)
    outputs, arrived, traffic = _ragged_exchange(rows_RxD, ids_R, params, cfg, n, m, kind,
                                                 fused=True)
    y_TxKxD, overflowed = outputs.reshape(-1, k, d), _overflowed(ids_R, arrived, cfg.num_experts)
  aux = _aux(routed, ALL, cfg, traffic, jax.lax.psum(overflowed, ALL))
  return mp_all_gather(_weighted_sum(y_TxKxD, routed).astype(x_TxD.dtype)), aux


def _s2(x_TxD, params, router_in=None, *, cfg: MoEConfig, n: int, m: int, kind: str | None):
  """Parm S2: gate, MP split of the dispatched tensor, fused exchange, MP all-gather of the expert
  outputs (ETM), gate combine."""
  d, k = x_TxD.shape[-1], cfg.choices_per_token
  routed = gate((x_TxD if router_in is None else router_in)[None], params, cfg, pad_to=m)
  if kind is None:  # the dispatched tensor [E, C, d], split on its capacity axis (padded to m chunks)
    buffer = _scatter_rows(x_TxD, routed.slots[0], routed.num_slots).reshape(cfg.num_experts, routed.padded, d)
    mine = mp_split(buffer, 1)
    outputs = _fused_exchange(mine.reshape(-1, d), params, cfg, n, m)
    gathered = mp_all_gather(outputs.reshape(mine.shape), axis=1)
    y_TxKxD = _rows_of_slots(gathered.reshape(-1, d), routed.slots[0])
    in_mine = routed.keep & (routed.positions // mine.shape[1] == jax.lax.axis_index(GPU))
    overflowed = jnp.zeros((cfg.num_experts,), jnp.int32)
    traffic = _dense_traffic(_kept_per_node(routed, cfg, n, in_mine), ALL, n, m)
  else:  # the token-choice rows [T * K, d], split in m chunks (padded with unsent rows)
    rows_RxD, ids_R = _choice_rows(x_TxD, routed)
    pad = -ids_R.shape[0] % m
    rows_RxD, ids_R = jnp.pad(rows_RxD, ((0, pad), (0, 0))), jnp.pad(ids_R, (0, pad), constant_values=-1)
    ids_mine = _my_chunk(ids_R, 0)
    outputs, arrived, traffic = _ragged_exchange(mp_split(rows_RxD, 0), ids_mine, params, cfg, n,
                                                 m, kind, fused=True)
    y_TxKxD = mp_all_gather(outputs)[:x_TxD.shape[0] * k].reshape(-1, k, d)
    overflowed = jax.lax.psum(_overflowed(ids_mine, arrived, cfg.num_experts), GPU)  # each GPU's chunk
  aux = _aux(routed, NODE, cfg, traffic, jax.lax.psum(overflowed, NODE))
  return _weighted_sum(y_TxKxD, routed).astype(x_TxD.dtype), aux


_SCHEDULES = {"baseline": _baseline, "s1": _s1, "s2": _s2}


def _kept_per_node(routed: Gate, cfg: MoEConfig, n: int, sent=None):
  """[n] kept token-choices of group 0 (restricted to `sent` [1, T, K] if given) per destination node."""
  sent = routed.keep if sent is None else sent
  node = routed.ids // (cfg.num_experts // n)
  return plan_lib.histogram(jnp.where(sent, node, -1)[0], n)


def _dense_traffic(rows_to_node, hop, n: int, m: int):
  """[D, D] rows of a dense dispatch all-to-all that carry a kept choice: over 'node' (baseline) each
  device sends to the GPU with its index; over both axes (Dump) to every GPU of the node."""
  return layer.global_traffic(rows_to_node if hop == NODE else jnp.repeat(rows_to_node, m), hop, n, m)


def _aux(routed: Gate, distinct_over, cfg: MoEConfig, traffic, overflowed_E):
  """aux from group 0 of the routing, summed over `distinct_over`: the mesh axes along which devices hold
  different tokens ('node' when the tokens are replicated over 'gpu'). overflowed_E: [E] global counts
  of the choices that overflowed a receive buffer (processed by no expert)."""
  first = jax.tree.map(lambda a: a[0], routed.stats)
  aux = routing.aux_losses(jax.lax.psum(first, distinct_over), cfg)
  kept_ids = jnp.where(routed.keep[0], routed.ids[0], -1)
  aux["expert_counts"] = jax.lax.psum(plan_lib.histogram(kept_ids, cfg.num_experts), distinct_over) - overflowed_E
  aux["tokens_dropped"] = jax.lax.psum(jnp.sum(~routed.keep[0], dtype=jnp.int32), distinct_over)
  aux["tokens_overflowed"] = jnp.sum(overflowed_E)
  aux["traffic_rows"] = traffic[None]
  return aux
