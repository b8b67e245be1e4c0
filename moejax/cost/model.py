"""`price_from_traffic`: the modelled time of one MoE layer from the traffic its routing really produced.

The breakdown has four parts: inter-node all-to-all (exchanges with messages that cross NICs),
intra-node all-to-all (exchanges that stay inside nodes), expert compute (FLOPs of the busiest
device at the device rate) and other (non-expert FLOPs at the same rate; callers add gradient sync
from `collectives.ring`). A forward runs every hop twice: dispatch (traffic_rows[h]) and combine
(its transpose, hops in reverse order). backward=True adds the backward's two exchanges per hop
and triples the FLOPs (the backward of a matmul costs two).

A row's bytes differ by exchange (`RowBytes`, built from the wire's dtypes by `wire_row_bytes`): the dispatch
carries the payload in the dispatch dtype (FP8's scales included) and its slots' ids and weights, the combine
the result in the combine dtype; the backward's exchanges carry gradients in the combine dtype, the dispatch's
the other way as a combine-sized row (and the weights' gradients), the combine's the dispatch's way. One number
for `bytes_per_row` prices every exchange alike.

What traffic to pass: `aux['traffic_rows']` is what the ragged exchanges move (with dedup one row per token and
destination of a hop, each carrying the token's choices there; without, one per token-choice). The dense
capacity dispatch (transport='capacity') moves every slot, padding included, so price
`traffic.capacity_traffic(...)` for it, not the kept-token counts.
"""

import dataclasses
import json

import numpy as np

from moejax.cost import collectives
from moejax.cost.topology import Topology
from moejax.moe import wire as wire_lib
from moejax.runtime import mesh as mesh_lib

ID_BYTES = WEIGHT_BYTES = FLAG_BYTES = 4  # a slot's int32 expert id, float32 weight, int32 arrival flag


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Seconds per part of one layer; `hops`: the dispatch exchange of every hop, in order.

  hidden_s: seconds of the parts that run at the same time as others under an overlap schedule
  (`overlap.price_schedule`), so total_s = the parts' sum - hidden_s; 0 for a sequential layer.
  """

  inter_node_a2a_s: float
  intra_node_a2a_s: float
  expert_compute_s: float
  other_s: float
  hops: tuple[collectives.ExchangeCost, ...]
  device_rate: float
  rate_source: str
  topology: str
  label: str = "modelled"
  hidden_s: float = 0.0

  @property
  def total_s(self) -> float:
    return self.inter_node_a2a_s + self.intra_node_a2a_s + self.expert_compute_s + self.other_s - self.hidden_s

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total_s=self.total_s)


def matmul_flops(rows, d_in: int, d_out: int):
  """FLOPs of `rows` rows times a [d_in, d_out] matrix: 2 * rows * d_in * d_out (a multiply and an add each)."""
  return 2 * np.asarray(rows, np.float64) * d_in * d_out


def expert_flops(rows, d_model: int, d_ff: int, gated: bool = False):
  """Forward FLOPs of the expert FFN on `rows` rows (token-choices; a number or an array, float64):

    not gated  2 matmuls (d -> f, f -> d):             2 * 2 * rows * d * f
    gated      3 matmuls (gate and up d -> f, f -> d):  3 * 2 * rows * d * f

  The backward costs twice the forward (forward + backward: 3x)."""
  return (3 if gated else 2) * matmul_flops(rows, d_model, d_ff)


def non_moe_flops(tokens: int, seq_len: int, d_model: int, d_ff: int, layers: int, moe_layers: int, vocab: int,
                  gated: bool = False, predicted: int | None = None) -> float:
  """Forward FLOPs per device of a micro batch of `tokens` tokens outside the MoE layers: attention
  projections (8 d^2 per token) and scores (4 seq d), the dense FFNs of the layers - moe_layers
  other blocks, and the vocabulary projection (2 d vocab) on `predicted` tokens (None: all; a
  BERT-style MLM head that runs on the masked positions only: those)."""
  predicted = tokens if predicted is None else predicted
  return (tokens * layers * (8 * d_model ** 2 + 4 * seq_len * d_model) + predicted * 2 * d_model * vocab
          + (layers - moe_layers) * float(expert_flops(tokens, d_model, d_ff, gated)))


def training_step_s(non_moe_flops: float, rate: float, moe_layer: Breakdown, moe_layers: int, accumulation: int,
                    sync_s: float) -> float:
  """Seconds of one optimizer step on a GPU: `accumulation` micro batches, each the forward and
  backward of the non-MoE FLOPs at `rate` (x3: a matmul's backward costs two) and of every MoE layer
  (`moe_layer`: priced with backward=True), then the gradient sync (`collectives.ring`)."""
  return accumulation * (3 * non_moe_flops / rate + moe_layers * moe_layer.total_s) + sync_s


def default_rate(topology: Topology) -> tuple[float, str]:
  """(FLOP/s, source): the topology's datasheet peak times its stated efficiency."""
  peak, eff = topology.peak_flops, topology.compute_efficiency
  return peak.value * eff.value, f"{peak.kind} peak {peak.value / 1e12:g} TFLOP/s x {eff.kind} efficiency {eff.value:g}"


def measured_rate(path, field: str = "tflops", impl: str = "dense_gemm",
                  name: str | None = None) -> tuple[float, str]:
  """(FLOP/s, source) from a benchmark JSON: its top-level `field` (TFLOP/s) if present, else the
  largest `field` among its `results` entries whose 'impl' is `impl` (experiments/bench_kernels.py).
  `name`: the file as the source names it (default: `path`)."""
  with open(path) as f:
    record = json.load(f)
  name = path if name is None else name
  device = record.get("device_kind") or record.get("device") or "unknown device"
  if isinstance(record.get(field), (int, float)):
    return record[field] * 1e12, f"measured: {name} {field} on {device}"
  values = [e[field] for e in record.get("results", []) if e.get("impl") == impl and field in e]
  if not values:
    raise ValueError(f"{path} has no top-level {field!r} and no results with impl={impl!r} and {field!r}")
  return max(values) * 1e12, f"measured: {name} max {field} of impl={impl} on {device}"


@dataclasses.dataclass(frozen=True)
class RowBytes:
  """Bytes of one row in each exchange of a layer (s: the token's device, p: its experts' device).

  dispatch: forward, s -> p; combine: forward, p -> s; dispatch_grad: the dispatch's backward, p -> s;
  combine_grad: the combine's backward, s -> p.
  """

  dispatch: float
  combine: float
  dispatch_grad: float
  combine_grad: float

  @classmethod
  def uniform(cls, bytes_per_row: float) -> "RowBytes":
    """Every exchange at the same bytes per row."""
    return cls(bytes_per_row, bytes_per_row, bytes_per_row, bytes_per_row)

  @property
  def backward(self) -> "RowBytes":
    """The backward's exchanges in the forward's places: the combine's gradients travel the dispatch's way
    (s -> p), the dispatch's come back the combine's way (p -> s)."""
    return RowBytes(self.combine_grad, self.dispatch_grad, self.combine, self.dispatch)

  def passes(self, backward: bool) -> tuple["RowBytes", ...]:
    """The forward's bytes, then with `backward` the backward's (`backward` property): one per pass."""
    return (self, self.backward) if backward else (self,)


def as_row_bytes(bytes_per_row: "float | RowBytes") -> RowBytes:
  """`bytes_per_row` as `RowBytes` (a number: every exchange alike)."""
  return bytes_per_row if isinstance(bytes_per_row, RowBytes) else RowBytes.uniform(float(bytes_per_row))


def wire_row_bytes(d: int, slots: int, itemsize: int, dispatch_dtype: str | None = None,
                   combine_dtype: str | None = None, may_drop: bool = False) -> RowBytes:
  """A row's bytes in each exchange as the layer moves it (`moejax.moe.traffic.traffic_bytes` for the forward).

  d: the row's width; slots: the choices a row carries (with dedup the token's K, without 1); itemsize: the
  activations' bytes per element (the dispatch's payload and its gradient when their dtype is None); the dtypes
  as `MoEConfig.dispatch_dtype` / `combine_dtype` (`moejax.moe.wire.payload_bytes`: FP8 adds a float32 scale
  per 128 elements); may_drop: a hop may drop entries (a bounded buffer, the dense kind), so the slots' int32
  arrival flags come back with the results.

    dispatch       payload(dispatch_dtype, activations) + slots x (int32 id + float32 weight)
    combine        payload(combine_dtype, float32) + slots x int32 flag where a hop may drop
    dispatch_grad  payload(combine_dtype, activations) + slots x float32 (the weights' gradients)
    combine_grad   payload(combine_dtype, float32)

  (the experts' results are float32 rows, so a None combine dtype moves 4 bytes per element both ways).
  """
  payload = wire_lib.payload_bytes
  return RowBytes(
      dispatch=payload(dispatch_dtype, d, itemsize) + slots * (ID_BYTES + WEIGHT_BYTES),
      combine=payload(combine_dtype, d, 4) + (slots * FLAG_BYTES if may_drop else 0),
      dispatch_grad=payload(combine_dtype, d, itemsize) + slots * WEIGHT_BYTES,
      combine_grad=payload(combine_dtype, d, 4))


def price_hops(traffic_rows, hops, mesh_shape, bytes_per_row: float,
               topology: Topology) -> tuple[collectives.ExchangeCost, ...]:
  """The dispatch exchange of every hop: traffic_rows [hops, A, A] (rows s -> p), hops: the hop axes."""
  traffic_rows = np.asarray(traffic_rows)
  n, m = mesh_shape
  if traffic_rows.ndim != 3 or traffic_rows.shape[1:] != (n * m, n * m) or len(hops) != traffic_rows.shape[0]:
    raise ValueError(f"traffic_rows {traffic_rows.shape} must be [hops={len(hops)}, {n * m}, {n * m}] "
                     f"for mesh {mesh_shape}")
  if m > topology["gpus_per_node"]:
    raise ValueError(f"mesh has {m} GPUs per node; topology {topology.name} has {topology['gpus_per_node']:g}")
  return tuple(collectives.all_to_all(rows * bytes_per_row, mesh_lib.same_group(hop, n, m), m, topology)
               for rows, hop in zip(traffic_rows, hops))


def price_exchanges(traffic_rows, hops, mesh_shape, bytes_per_row: "float | RowBytes", topology: Topology,
                    backward: bool = False) -> tuple[tuple[collectives.ExchangeCost, ...], ...]:
  """Every exchange of the layer, one tuple per pass (the forward; with `backward`, then the backward): the
  dispatch of every hop at the pass's dispatch bytes per row, then the combine (the rows transposed, hops in
  reverse order) at its combine bytes (`RowBytes.passes`). traffic_rows [hops, A, A] as `price_hops` takes it."""
  rows = np.asarray(traffic_rows)
  back = np.swapaxes(rows, 1, 2)[::-1]
  return tuple(price_hops(rows, hops, mesh_shape, wire.dispatch, topology)
               + price_hops(back, hops[::-1], mesh_shape, wire.combine, topology)
               for wire in as_row_bytes(bytes_per_row).passes(backward))


def price_from_traffic(traffic_rows, hops, mesh_shape, bytes_per_row: "float | RowBytes", flops, topology: Topology,
                       device_rate: float | tuple[float, str] | None = None, *, other_flops: float = 0.0,
                       non_expert_s: float = 0.0, backward: bool = False) -> Breakdown:
  """Prices one MoE layer from the rows its exchanges move and the FLOPs its devices compute.

  traffic_rows: [hops, A, A] rows flat device s sends to p in each hop (the layer's aux['traffic_rows']).
  hops: the H hop axes, e.g. [('node', 'gpu')] (flat), ['gpu', 'node'] (hierarchical),
    ['node', 'gpu'] (bi-level).
  mesh_shape: (n, m). bytes_per_row: a row's bytes in each exchange (`RowBytes`, e.g. `wire_row_bytes`), or one
    number for all of them (d_model * bytes per element).
  flops: forward expert FLOPs per device, a number or [A] (the busiest device sets the time); see
    `expert_flops` and `traffic.rows_processed`.
  device_rate: FLOP/s of one device, or (FLOP/s, source) as `measured_rate` returns;
    None = `default_rate(topology)`.
  other_flops: forward non-expert FLOPs per device (router, combine), priced at the same rate.
  non_expert_s: forward seconds of the memory-bound non-expert phases (`cost.phases`); the backward pays
    them twice more, like the FLOPs.
  """
  if device_rate is None:
    device_rate = default_rate(topology)
  rate, rate_source = device_rate if isinstance(device_rate, tuple) else (device_rate, "given")
  passes = price_exchanges(traffic_rows, hops, mesh_shape, bytes_per_row, topology, backward)
  exchanges = [c for one_pass in passes for c in one_pass]
  inter = sum(c.time_s for c in exchanges if c.crosses_nodes)
  intra = sum(c.time_s for c in exchanges if not c.crosses_nodes)
  flops_factor = 3 if backward else 1
  return Breakdown(inter_node_a2a_s=inter, intra_node_a2a_s=intra,
                   expert_compute_s=flops_factor * float(np.max(flops)) / rate,
                   other_s=flops_factor * (float(other_flops) / rate + non_expert_s), hops=passes[0][:len(hops)],
                   device_rate=rate, rate_source=rate_source, topology=topology.name)
