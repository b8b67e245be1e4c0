"""Modelled rows: a sweep point's MoE layer priced by the cluster cost model from its small run, and
the training step built around it.

How the small run is scaled to the modelled tokens (T = micro_batch * seq_len per GPU): the
simulated layer (widths sim.d_model, sim.d_ff) routes sim.batches batches of sim.tokens_per_gpu
random N(0, I) tokens per device, with an untrained router (with sim.balanced_router, one built to
route uniformly: see `inputs.balanced_routers`). Its traffic matrices (rows each device sent to each
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
  (the BERT-MoE model of `moejax.train.model`, whose MLM head runs on the T_mask = 15% masked tokens)
  step = accumulation * micro + ring all-reduce of the dense parameters over all devices
Scaling follows SMILE Sec. 4.3.1: weak = fixed per-GPU batch (micro batch per GPU, one micro batch
per step, the global batch grows with the devices); strong = fixed global batch `global_batch` and
fixed micro batch (accumulation = global_batch / (devices * micro_batch) falls as devices grow).
Throughput is global_batch / step in samples/s.
"""

import math

import jax.numpy as jnp
import numpy as np

from moejax.cost import collectives
from moejax.cost import model as cost_model
from moejax.cost import traffic as traffic_lib
from moejax.moe.layer import traffic_summary
from moejax.moe.transport import transport_hops
from moejax.study.points import Point, identity, scheme_config, topology
from moejax.train import objective


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
  args = (rows, transport_hops(cfg.transport), (n, m), bytes_per_row, flops, topology(config), device_rate(config))
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
  return {**identity(point), "tokens_per_gpu": tokens, "global_batch": global_batch,
          "accumulation": accumulation, **stats,
          "layer_inter_ms": 1e3 * fwd.inter_node_a2a_s, "layer_intra_ms": 1e3 * fwd.intra_node_a2a_s,
          "layer_expert_ms": 1e3 * fwd.expert_compute_s, "layer_other_ms": 1e3 * fwd.other_s,
          "layer_ms": 1e3 * fwd.total_s, "grad_sync_ms": 1e3 * sync_s, "step_s": step_s,
          "samples_per_s": global_batch / step_s, "topology": cluster.name,
          "device_tflops": rate / 1e12, "rate_source": rate_source}
