"""Modelled rows: a sweep point's MoE layer priced by the cluster cost model from its small run, and its training step.

How the small run is scaled to the modelled tokens (T = micro_batch * seq_len per GPU): the simulated layer (widths
sim.d_model, sim.d_ff) routes sim.batches batches of sim.tokens_per_gpu random N(0, I) tokens per device, with an
untrained router (with sim.balanced_router, one built to route uniformly: see `inputs.balanced_routers`). Its traffic
matrices (rows each device sent to each device, every hop) and per-device expert rows, summed over the batches, are
multiplied by T / (batches * tokens_per_gpu) and rounded: the routing fractions of the small run are kept and the rows
scale linearly. The overlap schedules ('chunked', 'comet') move the flat dropless layer's rows in pieces, so they take
its small run and are priced by `cost.overlap` (exchanges and matmuls overlapped; the GEMM pieces' efficiency from its
wave model with `gemm_sms` SMs). Parm's schemes ('esp_baseline', 's1', 's2') run no small run: `cost.parm` prices their
collectives from the config (uniform capacity dispatch, T = k f B L / E, moe.dtype's bytes per element) with alpha-beta
terms derived from the topology. Two effects of the small run carry over: its sampling noise (the busiest device's
excess load shrinks with more tokens, so scaling it up overstates imbalance), and its capacity drops (capacity is
applied per batch and binds harder on few tokens; `sim_dropped_fraction` is in every row). The dense capacity dispatch
('switch') moves every slot whatever the routing, so it is priced exactly at the modelled scale: `capacity_traffic` with
C = ceil(capacity_factor * T * k / E), every slot computed. The ragged collectives move only the rows routed, without
capacity padding.

What a row costs on the wire (`moe.wire.layer_row_bytes`): each exchange prices its own bytes per row at the model's
d_model, from the point's moe.dispatch_dtype and combine_dtype (None: the dispatch in moe.dtype, the activations' dtype
here, the combine in float32, as the layer moves them) and its slots: a row carries a slot (an int32 id and a float32
weight) per choice it holds, the token's K with dedup (one row per destination of a hop), 1 without (one row per
token-choice). The combine adds the slots' int32 arrival flags where a hop may drop (moe.buffer_factor, the dense
capacity dispatch), and the backward's exchanges carry gradients in the combine dtype, the dispatch's back to the token
with its weights' gradients (`cost.wire_lib.RowBytes`). The rows come from the small run; the dtypes only reprice it.

The layer's collectives that carry no rows (the plans' all-gathers of send sizes, the statistics' all-reduces) are
read from the small run's compiled layer (the point's mesh; sizes independent of tokens and widths) and priced on the
topology (`cost.program_price`), once per pass through the layer.

Outside the exchanges and the expert GEMMs, each layer pays its router FLOPs, the combine's and the shared experts' at
the device rate, and its memory-bound non-expert phases (routing, sort, gather, weighted scatter) at the measured H100
cost per routed-row byte carried to the topology's GPU by memory bandwidth (`cost.phases.for_topology`, the cost the
Comet validation uses); the backward pays both twice more, comet's fused kernels none of the second.

The step model (`cost.model.training_step_s`, per GPU):
  micro = 3 * non-MoE FLOPs / rate + moe_layers * (MoE layer forward + backward, priced)
  non-MoE FLOPs = `point_models.forward_flops` (SMILE's BERT-MoE: layers * (8 d^2 + 4 seq d) T
  + (layers - moe_layers) * FFN(T) + 2 d vocab T_mask, its MLM head on the T_mask = 15% masked tokens; the decoders:
  2 T per weight of their attention, dense FFNs and head, and causal attention's scores)
  step = accumulation * micro + ring all-reduce of the dense parameters (`point_models.dense_params`) over all
  devices (Parm's schemes: dense parts tensor parallel over the node's GPUs, see `model_row`)
Scaling follows SMILE Sec. 4.3.1: weak = fixed per-GPU batch (micro batch per GPU, one micro batch per step, the
global batch grows with the devices); strong = fixed global batch `global_batch` and fixed micro batch (accumulation
= global_batch / (devices * micro_batch) falls as devices grow). Throughput is global_batch / step in samples/s.
"""

import jax.numpy as jnp
import numpy as np

from moejax.cost import collectives, overlap, phases, program_price
from moejax.cost import model as cost_model
from moejax.cost import traffic as traffic_lib
from moejax.moe import routing
from moejax.moe import wire as wire_lib
from moejax.moe.traffic import traffic_summary
from moejax.study import point_models, points
from moejax.study.points import ESP_SCHEMES, OVERLAP_SCHEMES, Point, identity, moe_section, scheme_config
from moejax.study.price_esp import esp_breakdowns


def device_rate(config) -> tuple[float, str]:
  """(FLOP/s, source): the calibration's timed expert FFN, else device_rate_json's, else the topology's datasheet
  peak x efficiency."""
  calibrated = points.calibration(config)
  if calibrated and calibrated.rate:
    return calibrated.rate
  if config.device_rate_json:
    return cost_model.measured_rate(config.device_rate_json)
  return cost_model.default_rate(points.topology(config))


def non_expert_cost(config) -> phases.RowCost:
  """The memory-bound non-expert phases' seconds per routed byte: the calibration's timed layer, else the H100
  measurement carried to the topology's GPU (`phases.for_topology`)."""
  calibrated = points.calibration(config)
  if calibrated and calibrated.row_cost:
    return calibrated.row_cost
  return phases.for_topology(points.topology(config))


def _overlap_breakdowns(
  rows,
  processed,
  cfg,
  point: Point,
  config,
  bytes_per_row: wire_lib.RowBytes,
  other_flops,
  non_expert_s: float,
  control: float,
) -> dict:
  """'chunked' / 'comet': the flat layer's traffic and busiest device priced with overlap (`cost.overlap`)."""
  n, m = point.nodes, point.gpus_per_node
  model, cluster = config.models[point.model], points.topology(config)
  rate, rate_source = device_rate(config)
  busiest = int(np.argmax(processed))
  experts_per_gpu = cfg.num_experts // (n * m)
  hops = cfg.path_kind.hops
  exchanges = overlap.Exchanges(rows, hops, (n, m), bytes_per_row, cluster, busiest)
  shape = overlap.LayerShape(
    (processed[busiest] / experts_per_gpu,) * experts_per_gpu,
    model.d_model,
    model.d_ff,
    cfg.gated,
    rate,
    overlap.GemmCurve(sms=config.gemm_sms),
    non_expert_s,
  )
  out = {}
  for name, train in (("forward", False), ("train", True)):
    cost = overlap.price_schedule(cfg.schedule, exchanges, shape, cfg.num_chunks, train=train)
    out[name] = cost_model.Breakdown(
      inter_node_a2a_s=cost.inter_node_s,
      intra_node_a2a_s=cost.intra_node_s,
      expert_compute_s=cost.compute_s,
      other_s=(3 if train else 1) * other_flops / rate,
      hops=cost_model.price_hops(rows, hops, (n, m), bytes_per_row.dispatch, cluster),
      device_rate=rate,
      rate_source=rate_source,
      topology=cluster.name,
      hidden_s=cost.hidden_s,
      control_s=control,
    )
    out[f"{name}_hidden_fraction"] = cost.hidden_fraction
  return out


def other_flops_of(cfg, tokens: int, d_model: int) -> float:
  """FLOPs of a layer's forward outside its routed experts: router logits, the weighted combine and the shared
  experts' dense FFNs on every token (DeepSeek, Qwen2-MoE)."""
  router_width = sum(routing.router_widths(cfg).values())  # bilevel: node and local routers, n + E / n
  other_flops = 2 * tokens * d_model * (router_width + cfg.choices_per_token)  # router logits + weighted combine
  if cfg.num_shared_experts:
    other_flops += float(cost_model.expert_flops(tokens, d_model, cfg.shared_width, cfg.gated))
  return other_flops


def layer_settings(cfg, moe, d_model: int) -> dict:
  """What every row of a layer records of its config: the replicated parameters (routers, shared experts), choices
  per token, capacity, routing, path, collective, dedup and the wire dtypes."""
  router_width = sum(routing.router_widths(cfg).values())
  return {
    "moe_replicated": d_model * (router_width + (3 if cfg.gated else 2) * cfg.shared_width),
    "choices_per_token": cfg.choices_per_token,
    "capacity_factor": cfg.capacity_factor,
    "routing": cfg.routing,
    "path": cfg.path,
    "collective": cfg.collective,
    "dedup": cfg.deduplicates,
    "dispatch_dtype": cfg.dispatch_dtype or moe.dtype,
    "combine_dtype": cfg.combine_dtype or "float32",
  }


def scaled_traffic(sim: dict, cfg, point: Point, tokens: int) -> tuple[np.ndarray, np.ndarray, float]:
  """(rows [hops, A, A], rows processed per device [A], token scale) at `tokens` per GPU: the dense capacity dispatch
  exactly (every slot), else the small run's scaled by tokens / its tokens per GPU and rounded."""
  n, m = point.nodes, point.gpus_per_node
  scale = tokens / sim["tokens_per_gpu"]
  if cfg.collective_kind.fixed_blocks:
    rows = traffic_lib.capacity_traffic(n, m, cfg.num_experts, routing.expert_capacity(cfg, tokens), cfg.path_kind.hops)
    return rows, traffic_lib.rows_processed(rows), scale
  rows = np.rint(np.asarray(sim["traffic_rows"]) * scale).astype(np.int64)
  return rows, np.rint(np.asarray(sim["rows_per_device"]) * scale), scale


def traffic_stats(rows, processed, sim: dict, cfg, point: Point, wire: wire_lib.RowBytes, scale: float) -> dict:
  """The row's traffic statistics: inter- and intra-node MB per GPU (the forward's dispatch and combine bytes), a
  row's bytes each way, the busiest device's load over the mean, and the small run's tokens and drops."""
  n, m = point.nodes, point.gpus_per_node
  # a hop's inter-node rows out equal its rows back (the transpose), so each carries a dispatch and a combine row
  summary = traffic_summary(rows, m, wire.dispatch + wire.combine)
  sent = sim["tokens_per_gpu"] * n * m * cfg.choices_per_token
  return {
    "inter_node_mb_per_gpu": sum(h["inter_node_bytes"] for h in summary) / (n * m) / 1e6,
    "intra_node_mb_per_gpu": sum(h["intra_node_bytes"] for h in summary) / (n * m) / 1e6,
    "dispatch_bytes_per_row": wire.dispatch,
    "combine_bytes_per_row": wire.combine,
    "expert_load_imbalance": float(np.max(processed) / np.mean(processed)),
    "sim_tokens_per_gpu": sim["tokens_per_gpu"],
    "sim_dropped_fraction": sim["dropped"] / sent,
    "token_scale": scale,
  }


def price_point_layer(sim: dict | None, point: Point, config) -> dict:
  """The MoE layer of `point`'s model, priced at its micro batch from the scaled small run (`sim`; None for
  the schemes priced from the config alone, `points.simulated_scheme`).

  Returns the forward and forward+backward `Breakdown`s and the traffic statistics of the row: inter- and
  intra-node MB per GPU (the forward's dispatch and combine bytes), and a row's bytes each way.
  """
  model, moe = config.models[point.model], moe_section(config, point.model)
  n, m = point.nodes, point.gpus_per_node
  cfg = scheme_config(point.scheme, n, m, moe, model.d_model, model.d_ff)
  tokens = model.micro_batch * model.seq_len
  itemsize = np.dtype(jnp.dtype(moe.dtype)).itemsize
  other_flops = other_flops_of(cfg, tokens, model.d_model)
  # the memory-bound routing, sort, gather and scatter of the token-choice rows this device routes
  non_expert_s = non_expert_cost(config).seconds(tokens * cfg.choices_per_token, model.d_model, itemsize)
  common = layer_settings(cfg, moe, model.d_model)
  if point.scheme in ESP_SCHEMES:
    esp = esp_breakdowns(cfg, point, config, itemsize, other_flops, non_expert_s, device_rate(config))
    return {**common, **esp}
  rows, processed, scale = scaled_traffic(sim, cfg, point, tokens)
  wire = wire_lib.layer_row_bytes(cfg, model.d_model, itemsize)
  stats = traffic_stats(rows, processed, sim, cfg, point, wire, scale)
  if point.scheme in OVERLAP_SCHEMES:
    overlapped = _overlap_breakdowns(
      rows, processed, cfg, point, config, wire, other_flops, non_expert_s, control_s(sim, points.topology(config))
    )
    return {**common, **stats, **overlapped}
  flops = cost_model.expert_flops(processed, model.d_model, model.d_ff, cfg.gated)
  topology = points.topology(config)
  args = (rows, cfg.path_kind.hops, (n, m), wire, flops, topology, device_rate(config))
  rest = dict(other_flops=other_flops, non_expert_s=non_expert_s, control_s=control_s(sim, topology))
  return {
    **common,
    **stats,
    "forward": cost_model.price_from_traffic(*args, **rest),
    "train": cost_model.price_from_traffic(*args, **rest, backward=True),
  }


def control_s(sim: dict, topology) -> float:
  """The small run's compiled layer's collectives that carry no rows, priced on `topology` (their sizes do not
  scale with the tokens or the widths)."""
  return program_price.control_seconds(sim["control"], topology)


def model_parallel(point: Point) -> int:
  """GPUs that share one sample: Parm's schemes keep the dense parts tensor parallel over the node's GPUs (the
  MP group, N_MP = m; Megatron-LM), every other scheme is data parallel on every GPU (1)."""
  return point.gpus_per_node if point.scheme in ESP_SCHEMES else 1


def batch(point: Point, config) -> tuple[int, int]:
  """(global batch in samples, micro batches per GPU per step) under the point's scaling."""
  micro, replicas = config.models[point.model].micro_batch, point.devices // model_parallel(point)
  if point.scaling == "weak":
    return replicas * micro, 1
  return config.global_batch, config.global_batch // (replicas * micro)


def model_row(point: Point, config, layer: dict) -> dict:
  """The modelled row of a point: the layer breakdown (forward, ms) and the training step. Labelled 'extrapolated'
  where the sweep is calibrated and the point is larger (more nodes or GPUs per node) than any timed exchange.

  Tensor-parallel dense parts (`model_parallel` > 1): the non-MoE FLOPs split over the MP group, which all-reduces
  the activations twice in the forward and twice in the backward of every block (Megatron-LM, Shoeybi et al. 2019,
  Sec. 3), less the MLP's two in MoE blocks (the MoE layer's own collectives replace them), and each GPU's 1 / m of
  the dense gradients all-reduced over the nodes (m such rings share a node's NICs)."""
  model, moe = config.models[point.model], moe_section(config, point.model)
  tokens = model.micro_batch * model.seq_len
  cluster = points.topology(config)
  rate, rate_source = device_rate(config)
  mp = model_parallel(point)
  itemsize = np.dtype(jnp.dtype(moe.dtype)).itemsize
  flops = point_models.forward_flops(model, moe.gated) / mp
  global_batch, accumulation = batch(point, config)
  param_bytes = point_models.dense_params(model, layer["moe_replicated"], moe.gated) * itemsize / mp
  if mp == 1:
    sync_s = collectives.ring("all_reduce", param_bytes, point.nodes, point.gpus_per_node, cluster).time_s
    tensor_parallel_s = 0.0
  else:
    sync_s = collectives.ring("all_reduce", param_bytes, point.nodes, 1, cluster, concurrent=mp).time_s
    activation = collectives.ring("all_reduce", tokens * model.d_model * itemsize, 1, mp, cluster).time_s
    tensor_parallel_s = (4 * model.layers - 2 * model.moe_layers) * activation
  step_s = cost_model.training_step_s(
    flops, rate, layer["train"], model.moe_layers, accumulation, sync_s + accumulation * tensor_parallel_s
  )
  fwd = layer["forward"]
  stats = {k: v for k, v in layer.items() if k not in ("forward", "train", "moe_replicated", "train_hidden_fraction")}
  if "forward_hidden_fraction" in stats:
    stats["comm_hidden_fraction"] = stats.pop("forward_hidden_fraction")
  calibrated = points.calibration(config)
  label = "extrapolated" if calibrated and calibrated.extrapolates(point.nodes, point.gpus_per_node) else point.label
  return {
    **identity(point),
    "label": label,
    "tokens_per_gpu": tokens,
    "global_batch": global_batch,
    "accumulation": accumulation,
    **stats,
    "layer_inter_node_ms": 1e3 * fwd.inter_node_a2a_s,
    "layer_intra_node_ms": 1e3 * fwd.intra_node_a2a_s,
    "layer_expert_ms": 1e3 * fwd.expert_compute_s,
    "layer_other_ms": 1e3 * fwd.other_s,
    "layer_control_ms": 1e3 * fwd.control_s,
    "layer_hidden_ms": 1e3 * fwd.hidden_s,
    "layer_ms": 1e3 * fwd.total_s,
    "grad_sync_ms": 1e3 * sync_s,
    "tensor_parallel_ms": 1e3 * tensor_parallel_s,
    "step_s": step_s,
    "samples_per_s": global_batch / step_s,
    "topology": cluster.name,
    "device_tflops": rate / 1e12,
    "rate_source": rate_source,
  }
