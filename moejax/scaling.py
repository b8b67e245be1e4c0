"""Scaling sweeps: routing/transport schemes over meshes, model sizes, weak and strong scaling.

Every point (scheme, mesh n x m, model, scaling) runs the real layer (`moe_apply`) on a simulated
CPU mesh of that shape with few tokens, then the cluster cost model (`moejax.cost`) prices it at
the model's real shapes and token counts. Such rows are labelled 'modelled'. Points whose mesh fits
this machine's devices of measure.platform are also timed end to end (`measure`: a layer forward
and a real training step of `moejax.model`); those rows are labelled 'measured'.

How the small run is scaled to the modelled tokens (T = micro_batch * seq_len per GPU): the
simulated layer (widths sim.d_model, sim.d_ff) routes sim.batches batches of sim.tokens_per_gpu
random N(0, I) tokens per device, with an untrained router (with sim.balanced_router, one built to
route uniformly: see `balanced_routers`). Its traffic matrices (rows each device sent to each
device, every hop) and per-device expert rows, summed over the batches, are multiplied by
T / (batches * tokens_per_gpu) and rounded: the routing fractions of the small run are kept and
the rows scale linearly. Two effects of the small run carry over: its sampling noise (the busiest
device's excess load shrinks with more tokens, so scaling it up overstates imbalance), and its
capacity drops (capacity is applied per batch and binds harder on few tokens;
`sim_dropped_fraction` is in every row). The dense capacity dispatch ('switch') moves every slot
whatever the routing, so it is priced exactly at the modelled scale: `capacity_traffic` with
C = ceil(capacity_factor * T * k / E), every slot computed. The ragged transports move only the
rows routed, without capacity padding.

The step model (`cost.model.training_step_s`, per GPU):
  micro = 3 * non-MoE FLOPs / rate + moe_layers * (MoE layer forward + backward, priced)
  non-MoE FLOPs = layers * (8 d^2 + 4 seq d) T + (layers - moe_layers) * FFN(T) + 2 d vocab T_mask
  (the BERT-MoE model of `moejax.model`, whose MLM head runs on the T_mask = 15% masked tokens)
  step = accumulation * micro + ring all-reduce of the dense parameters over all devices
Scaling follows SMILE Sec. 4.3.1: weak = fixed per-GPU batch (micro batch per GPU, one micro batch
per step, the global batch grows with the devices); strong = fixed global batch `global_batch` and
fixed micro batch (accumulation = global_batch / (devices * micro_batch) falls as devices grow).
Throughput is global_batch / step in samples/s.
"""

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import mesh as mesh_lib
from moejax import objective, phase_timing, routing
from moejax import train as train_lib
from moejax.config import ConfigError, MoEConfig, is_int, require
from moejax.cost import collectives
from moejax.cost import model as cost_model
from moejax.cost import topology as topology_lib
from moejax.cost import traffic as traffic_lib
from moejax.kernels.tuning import time_call
from moejax.layer import ALL, hop_axes, init_params, moe_apply, param_specs, traffic_summary
from moejax.model import ModelConfig

SCHEMES = ("switch", "flat_dropless", "hierarchical", "smile", "node_limited")
SCALINGS = ("weak", "strong")
MODEL_FIELDS = ("d_model", "d_ff", "layers", "moe_layers", "seq_len", "micro_batch", "vocab")
POINTS_FILE = "points.jsonl"
SIMULATIONS_FILE = "simulations.jsonl"
# MoEConfig fields -> the sweep config fields that set them, so errors name what the user wrote.
_MOE_FIELDS = {"num_experts": "moe.experts_per_gpu", "top_k": "moe.top_k", "node_top_k": "moe.node_top_k",
               "activation": "moe.activation", "gated": "moe.gated", "dtype": "moe.dtype"}


@dataclasses.dataclass(frozen=True)
class Point:
  """One point of the sweep; `label` is 'modelled' or 'measured'."""

  scheme: str
  nodes: int
  gpus_per_node: int
  model: str
  scaling: str
  label: str = "modelled"

  @property
  def devices(self) -> int:
    return self.nodes * self.gpus_per_node

  @property
  def mesh(self) -> str:
    return f"{self.nodes}x{self.gpus_per_node}"


def scheme_config(scheme: str, n: int, m: int, moe, d_model: int, d_ff: int, platform: str) -> MoEConfig:
  """The MoEConfig of a named scheme on an n x m mesh (`moe`: the sweep's `config.moe`)."""
  common = dict(num_experts=moe.experts_per_gpu * n * m, d_model=d_model, d_ff=d_ff, activation=moe.activation,
                gated=moe.gated, dtype=moe.dtype)
  flat = "padded" if platform == "cpu" else "ragged"
  fields = {
      "switch": dict(routing="topk", top_k=1, transport="capacity", capacity_factor=moe.switch_capacity_factor),
      "flat_dropless": dict(routing="topk", top_k=moe.top_k, transport=flat),
      "hierarchical": dict(routing="topk", top_k=moe.top_k, transport="hierarchical"),
      "smile": dict(routing="bilevel", top_k=moe.top_k, num_nodes=n, transport="bilevel",
                    capacity_factor=moe.smile_capacity_factor),
      "node_limited": dict(routing="node_limited", top_k=moe.top_k, num_nodes=n, node_top_k=moe.node_top_k,
                           transport="bilevel"),
  }[scheme]
  try:
    return MoEConfig(**common, **fields)
  except ConfigError as e:
    field = f"moe.{scheme}_capacity_factor" if e.field == "capacity_factor" else _MOE_FIELDS.get(e.field, e.field)
    require(False, field, e.value, f"{e.allowed} (scheme {scheme!r} on mesh {n}x{m})")


def _positive_ints(value) -> bool:
  return (isinstance(value, (tuple, list)) and len(value) > 0
          and all(is_int(v) for v in value))


def validate(config) -> list[Point]:
  """Checks every field before JAX starts; returns the modelled points in run order."""
  require(config.topology in topology_lib.PRESETS, "topology", config.topology,
          f"one of {sorted(topology_lib.PRESETS)}")
  try:
    topology(config)
  except ValueError as e:
    require(False, "topology_overrides", config.topology_overrides, f"field=value,... of topology fields ({e})")
  require(not config.device_rate_json or os.path.isfile(config.device_rate_json), "device_rate_json",
          config.device_rate_json, "'' (datasheet peak x efficiency) or an existing benchmark JSON")
  for field in ("nodes", "gpus_per_node"):
    require(_positive_ints(config[field]), field, config[field], "a non-empty tuple of positive ints")
  max_gpus = topology(config)["gpus_per_node"]
  require(max(config.gpus_per_node) <= max_gpus, "gpus_per_node", config.gpus_per_node,
          f"at most {max_gpus:g}, the GPUs per node of topology {config.topology!r}")
  for field, allowed in (("schemes", SCHEMES), ("scalings", SCALINGS)):
    value = config[field]
    require(isinstance(value, (tuple, list)) and len(value) > 0 and set(value) <= set(allowed), field, value,
            f"a non-empty tuple of {allowed}")
  require(len(config.models) > 0, "models", config.models, "at least one named model")
  for name, model in config.models.items():
    unknown = sorted(set(model) - set(MODEL_FIELDS))
    require(not unknown, f"models.{name}", unknown, f"only the fields {MODEL_FIELDS}")
    for field in MODEL_FIELDS:
      value = model.get(field)
      require(is_int(value), f"models.{name}.{field}", value, "a positive int")
    require(model.layers % model.moe_layers == 0, f"models.{name}.moe_layers", model.moe_layers,
            f"a divisor of layers={model.layers} (an MoE layer every layers / moe_layers blocks)")
    require(model.vocab >= 3, f"models.{name}.vocab", model.vocab, "at least 3 (padding, mask, a token)")
  require(isinstance(config.sim.balanced_router, bool), "sim.balanced_router", config.sim.balanced_router,
          "True or False")
  for field in ("tokens_per_gpu", "batches", "d_model", "d_ff", "seed"):
    value = config.sim[field]
    require(isinstance(value, int) and value >= (0 if field == "seed" else 1), f"sim.{field}", value,
            "an int >= 0" if field == "seed" else "a positive int")
  require(config.measure.platform in ("gpu", "cpu"), "measure.platform", config.measure.platform,
          "'gpu' (time single-node points on this machine's GPUs) or 'cpu' (on its CPU devices)")
  for field in ("warmup", "repeats"):
    require(isinstance(config.measure[field], int) and config.measure[field] >= 1, f"measure.{field}",
            config.measure[field], "a positive int")
  meshes = [(n, m) for m in config.gpus_per_node for n in config.nodes]
  if "strong" in config.scalings:
    for name, model in config.models.items():
      for n, m in meshes:
        require(isinstance(config.global_batch, int) and config.global_batch % (n * m * model.micro_batch) == 0,
                "global_batch", config.global_batch,
                f"a multiple of devices x micro batch = {n * m * model.micro_batch} (mesh {n}x{m}, model {name}) "
                "for strong scaling")
  for n, m in meshes:
    for scheme in config.schemes:
      scheme_config(scheme, n, m, config.moe, config.sim.d_model, config.sim.d_ff, "cpu")
  return [Point(scheme, n, m, name, scaling) for n, m in meshes for scheme in config.schemes
          for name in config.models for scaling in config.scalings]


def max_devices(points: list[Point]) -> int:
  return max(p.devices for p in points)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def point_key(point: Point, config) -> str:
  """A digest of everything the point's row depends on, so reruns skip only identical points."""
  model = config.models[point.model].to_dict()
  settings = {"topology": config.topology, "topology_overrides": config.topology_overrides,
              "device_rate_json": config.device_rate_json,
              "moe": config.moe.to_dict(), "sim": config.sim.to_dict()}
  if point.scaling == "strong":
    settings["global_batch"] = config.global_batch
  if point.label == "measured":
    settings["measure"] = config.measure.to_dict()
  return _digest([dataclasses.asdict(point), model, settings])


def simulation_key(scheme: str, n: int, m: int, config) -> str:
  """A digest of what a small run depends on; models, topology and scaling only reprice it."""
  return _digest([scheme, n, m, config.moe.to_dict(), config.sim.to_dict()])


def cpu_mesh(n: int, m: int) -> jax.sharding.Mesh:
  """An n x m mesh of simulated CPU devices (also on a GPU machine)."""
  cpus = jax.devices("cpu")
  if len(cpus) < n * m:
    raise mesh_lib.MeshError(f"mesh {n}x{m} needs {n * m} CPU devices, JAX has {len(cpus)}; call "
                             f"moejax.mesh.simulate_cpu_devices({n * m}) before any JAX computation")
  return mesh_lib.make_mesh(n, m, devices=cpus[:n * m])


def _harmonic_frame(d: int, width: int) -> np.ndarray:
  """[d, width] unit columns w_e = R^e w_0, R a rotation of order `width` (angle 2 pi j / width in
  coordinate plane j): x ~ N(0, I) is invariant under R, so every column is the argmax of x @ w
  equally often, however many more columns than dimensions there are."""
  planes = d // 2
  angles = 2 * np.pi * np.outer(np.arange(width), np.arange(1, planes + 1)) / width
  frame = np.stack([np.cos(angles), np.sin(angles)], axis=-1).reshape(width, 2 * planes) / np.sqrt(planes)
  return np.pad(frame, ((0, 0), (0, d - 2 * planes))).T


def balanced_routers(cfg: MoEConfig, seed: int) -> dict:
  """Router kernels that route x ~ N(0, I) uniformly, standing in for a router trained with a
  load-balancing loss (a fresh random router favours the experts whose columns happen to be long
  or central: with d 32 and 128 experts the busiest gets about 4x the mean).

  When all routers have at most d columns together, the columns are orthonormal: all logits are
  i.i.d., so the choices are uniform and independent (the node and local choices of 'bilevel'
  too). Otherwise each router is a randomly rotated `_harmonic_frame`: each router's choices are
  uniform, but with several routers their choices may be correlated.
  """
  rng = np.random.default_rng(seed)
  names, d = routing.router_names(cfg), cfg.d_model
  widths = [routing.router_widths(cfg)[name] for name in names]
  if sum(widths) <= d:
    kernels = np.split(np.linalg.qr(rng.standard_normal((d, sum(widths))))[0], np.cumsum(widths)[:-1], axis=1)
  else:
    kernels = [np.linalg.qr(rng.standard_normal((d, d)))[0] @ _harmonic_frame(d, w) for w in widths]
  return {name: {"kernel": kernel} for name, kernel in zip(names, kernels)}


def _params(cfg: MoEConfig, mesh, seed: int, dtype, balanced_router: bool) -> dict:
  """Fresh parameters (routers from `balanced_routers` if balanced_router) placed on `mesh`."""
  params = init_params(jax.random.key(seed), cfg, dtype)
  if balanced_router:
    params.update(jax.tree.map(lambda k: jnp.asarray(k, dtype), balanced_routers(cfg, seed)))
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs(cfg))


def _tokens(mesh, tokens: int, d: int, seed: int, dtype) -> jax.Array:
  """x [tokens, d] ~ N(0, I), sharded over the mesh's devices."""
  x = jax.random.normal(jax.random.key(seed), (tokens, d), dtype)
  return jax.device_put(x, NamedSharding(mesh, P(ALL)))


def simulate(scheme: str, n: int, m: int, config) -> dict:
  """The real layer on a simulated n x m CPU mesh: sim.batches calls of sim.tokens_per_gpu tokens per
  device (one compilation; more batches, less sampling noise in the routing fractions).

  Returns, summed over the batches and as JSON-ready lists: traffic_rows [H, D, D], rows_per_device
  [D] (token-choices each device's experts got), dropped (token-choices), tokens_per_gpu; and
  seconds (compile and run).
  """
  cfg = scheme_config(scheme, n, m, config.moe, config.sim.d_model, config.sim.d_ff, "cpu")
  cfg = dataclasses.replace(cfg, dtype="float32")
  mesh = cpu_mesh(n, m)
  start = time.perf_counter()
  params = _params(cfg, mesh, config.sim.seed, jnp.float32, config.sim.balanced_router)
  traffic, counts, dropped = 0, 0, 0
  for b in range(config.sim.batches):
    x = _tokens(mesh, n * m * config.sim.tokens_per_gpu, cfg.d_model, config.sim.seed + 1 + b, jnp.float32)
    _, aux = jax.block_until_ready(moe_apply(params, x, cfg, mesh))
    traffic = traffic + np.asarray(aux["traffic_rows"], np.int64)
    counts = counts + np.asarray(aux["expert_counts"], np.int64)
    dropped += int(aux["tokens_dropped"])
  return {"traffic_rows": traffic.tolist(), "rows_per_device": counts.reshape(n * m, -1).sum(axis=1).tolist(),
          "dropped": dropped, "tokens_per_gpu": config.sim.batches * config.sim.tokens_per_gpu,
          "seconds": time.perf_counter() - start}


def topology(config) -> topology_lib.Topology:
  """The preset `config.topology` with `config.topology_overrides` ('nic_bw=25e9,...') applied."""
  overrides = topology_lib.parse_overrides(config.topology_overrides)
  if not overrides:
    return topology_lib.get(config.topology)
  return topology_lib.custom(config.topology, name=f"{config.topology}+{config.topology_overrides}", **overrides)


def device_rate(config) -> tuple[float, str]:
  if config.device_rate_json:
    return cost_model.measured_rate(config.device_rate_json)
  return cost_model.default_rate(topology(config))


def price_layer(sim: dict, point: Point, config) -> dict:
  """The MoE layer of `point`'s model, priced at its micro batch from the scaled small run.

  Returns the forward and forward+backward `Breakdown`s and the traffic statistics of the row.
  """
  model, moe = config.models[point.model], config.moe
  n, m = point.nodes, point.gpus_per_node
  cfg = scheme_config(point.scheme, n, m, moe, model.d_model, model.d_ff, "cpu")
  tokens = model.micro_batch * model.seq_len
  scale = tokens / sim["tokens_per_gpu"]
  k = cfg.choices_per_token
  if cfg.transport == "capacity":
    capacity = math.ceil(cfg.capacity_factor * tokens * k / cfg.num_experts)
    rows = traffic_lib.capacity_traffic(n, m, cfg.num_experts, capacity)
    processed = traffic_lib.rows_processed(rows)
  else:
    rows = np.rint(np.asarray(sim["traffic_rows"]) * scale).astype(np.int64)
    processed = np.rint(np.asarray(sim["rows_per_device"]) * scale)
  bytes_per_row = model.d_model * np.dtype(jnp.dtype(moe.dtype)).itemsize
  router_width = n + cfg.num_experts // n if cfg.routing == "bilevel" else cfg.num_experts
  other_flops = 2 * tokens * model.d_model * (router_width + k)  # router logits + weighted combine
  flops = cost_model.expert_flops(processed, model.d_model, model.d_ff, moe.gated)
  args = (rows, hop_axes(cfg), (n, m), bytes_per_row, flops, topology(config), device_rate(config))
  summary = traffic_summary(rows, m, bytes_per_row)
  sent = sim["tokens_per_gpu"] * n * m * k
  return {"forward": cost_model.price_layer(*args, other_flops=other_flops),
          "train": cost_model.price_layer(*args, other_flops=other_flops, backward=True),
          "router_width": router_width,
          "inter_node_mb_per_gpu": 2 * sum(h["inter_node_bytes"] for h in summary) / (n * m) / 1e6,
          "intra_node_mb_per_gpu": 2 * sum(h["intra_node_bytes"] for h in summary) / (n * m) / 1e6,
          "expert_load_imbalance": float(np.max(processed) / np.mean(processed)),
          "sim_tokens_per_gpu": sim["tokens_per_gpu"], "sim_dropped_fraction": sim["dropped"] / sent,
          "token_scale": scale, "choices_per_token": k,
          "capacity_factor": cfg.capacity_factor, "routing": cfg.routing, "transport": cfg.transport}


def batch(point: Point, config) -> tuple[int, int]:
  """(global batch in samples, micro batches per GPU per step) under the point's scaling."""
  micro = config.models[point.model].micro_batch
  if point.scaling == "weak":
    return point.devices * micro, 1
  return config.global_batch, config.global_batch // (point.devices * micro)


def dense_params(model, router_width: int, gated: bool) -> float:
  """Parameters replicated on every device (all-reduced each step): attention, dense FFNs, the
  embedding and the routers. Experts are sharded one copy per expert, so they need no sync."""
  ffn = (3 if gated else 2) * model.d_model * model.d_ff
  return (model.layers * 4 * model.d_model ** 2 + (model.layers - model.moe_layers) * ffn
          + model.vocab * model.d_model + model.moe_layers * model.d_model * router_width)


def model_row(point: Point, config, layer: dict) -> dict:
  """The modelled row of a point: the layer breakdown (forward, ms) and the training step."""
  model, moe = config.models[point.model], config.moe
  tokens = model.micro_batch * model.seq_len
  cluster = topology(config)
  rate, rate_source = device_rate(config)
  predicted = model.micro_batch * objective.num_predictions(model.seq_len)  # the MLM head's tokens
  flops = cost_model.non_moe_flops(tokens, model.seq_len, model.d_model, model.d_ff, model.layers, model.moe_layers,
                                   model.vocab, moe.gated, predicted)
  global_batch, accumulation = batch(point, config)
  param_bytes = dense_params(model, layer["router_width"], moe.gated) * np.dtype(jnp.dtype(moe.dtype)).itemsize
  sync_s = collectives.ring("all_reduce", param_bytes, point.nodes, point.gpus_per_node, cluster).time_s
  step_s = cost_model.training_step_s(flops, rate, layer["train"], model.moe_layers, accumulation, sync_s)
  fwd = layer["forward"]
  stats = {k: v for k, v in layer.items() if k not in ("forward", "train", "router_width")}
  return {**_identity(point), "tokens_per_gpu": tokens, "global_batch": global_batch,
          "accumulation": accumulation, **stats,
          "layer_inter_ms": 1e3 * fwd.inter_node_a2a_s, "layer_intra_ms": 1e3 * fwd.intra_node_a2a_s,
          "layer_expert_ms": 1e3 * fwd.expert_compute_s, "layer_other_ms": 1e3 * fwd.other_s,
          "layer_ms": 1e3 * fwd.total_s, "grad_sync_ms": 1e3 * sync_s, "step_s": step_s,
          "samples_per_s": global_batch / step_s, "topology": cluster.name,
          "device_tflops": rate / 1e12, "rate_source": rate_source}


def _identity(point: Point) -> dict:
  return {"scheme": point.scheme, "nodes": point.nodes, "gpus_per_node": point.gpus_per_node,
          "devices": point.devices, "model": point.model, "scaling": point.scaling, "label": point.label}


def fits_real_devices(n: int, m: int, platform: str) -> bool:
  """Whether an n x m mesh can be built from this single process's devices of `platform`: on
  'gpu', one node (n = 1; multi-host points are modelled only); on 'cpu', any shape of the local,
  possibly simulated, devices (to exercise the measured path; CPU times say nothing about GPUs)."""
  if jax.process_count() != 1:
    return False
  try:
    count = len(jax.devices(platform))
  except RuntimeError:  # no such backend
    return False
  return n * m <= count and (platform == "cpu" or n == 1)


# LAMB as in SMILE (Sec. 4.1); the step's cost does not depend on these values.
_TIMING_OPTIM = {"learning_rate": 1e-3, "warmup_steps": 0, "decay": "linear", "decay_steps": 0, "end_fraction": 0.0,
                 "b1": 0.9, "b2": 0.999, "eps": 1e-6, "weight_decay": 0.01, "clip_norm": 1.0}


def training_model(model, dtype: str) -> ModelConfig:
  """The BERT-like model (`moejax.model`) of a sweep model: every (layers / moe_layers)-th FFN is an
  MoE layer, heads of width 64 (one head if d_model is not a multiple of 64), dropout 0.1 as in SMILE."""
  heads = model.d_model // 64 if model.d_model % 64 == 0 else 1
  return ModelConfig(kind="bert", vocab_size=model.vocab, num_layers=model.layers, d_model=model.d_model,
                     num_heads=heads, d_ff=model.d_ff, max_len=model.seq_len,
                     dropout=0.1, moe_every=model.layers // model.moe_layers, dtype=dtype)


def measure(point: Point, config, layers: dict) -> dict:
  """Wall-clock on this machine's devices of platform measure.platform, at the model's shapes: one
  MoE layer forward at the micro batch with its phases (`phase_timing.measure_phases`: inter- and
  intra-node exchanges, expert FFN, the rest), and the whole training step (`moejax.train.Trainer`:
  the point's global batch as accumulation micro batches of random tokens, forward, backward, LAMB
  update). Each: a compiling call and measure.warmup untimed calls, then the median of
  measure.repeats (`time_call`). `layers` keeps the layer's timings by (scheme, mesh, model) for
  the other scaling's point."""
  model, moe, platform = config.models[point.model], config.moe, config.measure.platform
  n, m = point.nodes, point.gpus_per_node
  cfg = scheme_config(point.scheme, n, m, moe, model.d_model, model.d_ff, platform)
  mesh = mesh_lib.make_mesh(n, m, devices=jax.devices(platform)[:n * m])
  tokens = model.micro_batch * model.seq_len
  dtype = jnp.dtype(moe.dtype)
  key = (point.scheme, point.mesh, point.model)
  if key not in layers:
    params = _params(cfg, mesh, config.sim.seed, dtype, config.sim.balanced_router)
    x = _tokens(mesh, point.devices * tokens, cfg.d_model, config.sim.seed + 1, dtype)
    layers[key] = phase_timing.measure_phases(params, x, cfg, mesh, config.measure.warmup, config.measure.repeats)
    del params, x

  global_batch, accumulation = batch(point, config)
  steps = 1 + config.measure.warmup + config.measure.repeats  # time_call's first call compiles
  train_config = ml_collections.ConfigDict({"seed": config.sim.seed, "steps": steps, "optim": _TIMING_OPTIM,
                                            "data": {"mask_prob": objective.MASK_PROB}})
  ids = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=model.vocab - 2,
                           num_ids=model.vocab)
  trainer = train_lib.Trainer(train_config, training_model(model, moe.dtype), cfg, mesh, ids)
  state, rest = trainer.init()
  shape = (accumulation, global_batch // accumulation, model.seq_len)
  batch_tokens = jax.device_put(jax.random.randint(jax.random.key(config.sim.seed + 2), shape, 2, model.vocab),
                                trainer.batch_sharding)
  losses = []

  def step():
    nonlocal state
    state, metrics = trainer.step(state, rest, batch_tokens)
    losses.append(metrics["loss"])
    return state

  step_times = time_call(step, (), config.measure.warmup, config.measure.repeats)
  step_s = statistics.median(step_times)
  return {**_identity(point), "routing": cfg.routing, "transport": cfg.transport,
          "choices_per_token": cfg.choices_per_token, "capacity_factor": cfg.capacity_factor,
          "tokens_per_gpu": tokens, "global_batch": global_batch, "accumulation": accumulation,
          **layers[key], "step_s": step_s, "step_s_min": min(step_times), "samples_per_s": global_batch / step_s,
          "loss_first": float(losses[0]), "loss_last": float(losses[-1]), "repeats": config.measure.repeats,
          "device": jax.devices(platform)[0].device_kind, "jax_version": jax.__version__}


def load_jsonl(path: str) -> dict[str, dict]:
  """key -> record of a JSONL file of records with a 'key' field ({} if there is no file).

  A last line without its newline is a record cut off by an interrupted run: it is removed, so
  the next append starts on a line of its own.
  """
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    text = f.read()
  complete, _, cut = text.rpartition("\n")
  if cut:
    logging.warning("%s: dropping an unfinished last record (%d characters)", path, len(cut))
    with open(path, "w") as f:
      f.write(complete + "\n" if complete else "")
  records = [json.loads(line) for line in complete.split("\n") if line.strip()]
  return {record["key"]: record for record in records}


def _append(f, record: dict) -> None:
  f.write(json.dumps(record) + "\n")
  f.flush()


def run(config, workdir: str) -> tuple[list[dict], dict]:
  """Runs every point not yet stored in workdir/points.jsonl, appending each as it finishes; small
  runs are kept in workdir/simulations.jsonl, so a point that only reprices one reruns nothing.

  Returns (rows of this config's points in run order, counts of points 'computed' and 'skipped'
  and of small runs 'simulated').
  """
  points = validate(config)
  points += [dataclasses.replace(p, label="measured") for p in points
             if fits_real_devices(p.nodes, p.gpus_per_node, config.measure.platform)]
  os.makedirs(workdir, exist_ok=True)
  points_path, sims_path = os.path.join(workdir, POINTS_FILE), os.path.join(workdir, SIMULATIONS_FILE)
  done, sims = load_jsonl(points_path), load_jsonl(sims_path)
  rows, counts, measured_layers = [], {"computed": 0, "skipped": 0, "simulated": 0}, {}
  with open(points_path, "a") as point_file, open(sims_path, "a") as sim_file:
    for i, point in enumerate(points, 1):
      key = point_key(point, config)
      where = f"[{i}/{len(points)}] {point.scheme} {point.mesh} {point.model} {point.scaling} {point.label}"
      if key in done:
        rows.append(done[key])
        counts["skipped"] += 1
        logging.info("%s: done before, skipped", where)
        continue
      start = time.perf_counter()
      if point.label == "measured":
        row = measure(point, config, measured_layers)
      else:
        sim_key = simulation_key(point.scheme, point.nodes, point.gpus_per_node, config)
        if sim_key not in sims:
          sims[sim_key] = {**simulate(point.scheme, point.nodes, point.gpus_per_node, config), "key": sim_key}
          _append(sim_file, sims[sim_key])
          counts["simulated"] += 1
        row = model_row(point, config, price_layer(sims[sim_key], point, config))
      row["key"] = key
      _append(point_file, row)
      rows.append(row)
      counts["computed"] += 1
      throughput = f", {row['samples_per_s']:.4g} samples/s" if "samples_per_s" in row else ""
      logging.info("%s: layer %.4g ms%s (%.1f s)", where, row["layer_ms"], throughput,
                   time.perf_counter() - start)
  return rows, counts
