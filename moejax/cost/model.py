"""`price_from_traffic`: the modelled time of one MoE layer from the traffic its routing really produced.

The breakdown has four parts: inter-node all-to-all (exchanges with messages that cross NICs),
intra-node all-to-all (exchanges that stay inside nodes), expert compute (FLOPs of the busiest
device at the device rate) and other (non-expert FLOPs at the same rate; callers add gradient sync
from `collectives.ring`). A forward runs every hop twice: dispatch (traffic_rows[h]) and combine
(its transpose, hops in reverse order). backward=True adds the backward's two exchanges per hop
and triples the FLOPs (the backward of a matmul costs two).

A row's bytes differ by exchange (`moe.wire.RowBytes` from `moe.wire.row_bytes`): the dispatch
carries the payload in the dispatch dtype (FP8's scales included) and its slots' ids and weights, the combine
the result in the combine dtype; the backward's exchanges carry gradients in the combine dtype, the dispatch's
the other way as a combine-sized row (and the weights' gradients), the combine's the dispatch's way. One number
for `bytes_per_row` prices every exchange alike.

What traffic to pass: `aux['traffic_rows']` is what the ragged exchanges move (with dedup one row per token and
destination of a hop, each carrying the token's choices there; without, one per token-choice). The dense
capacity dispatch (collective='capacity') moves every slot, padding included, so price
`traffic.capacity_traffic(...)` for it, not the kept-token counts.
"""

import dataclasses
import json

import numpy as np

from moejax.cost import collectives
from moejax.cost.topology import Topology
from moejax.moe.wire import RowBytes
from moejax.runtime import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Seconds per part of one layer; `hops`: the dispatch exchange of every hop, in order.

  hidden_s: seconds of the parts that run at the same time as others under an overlap schedule
  (`overlap.price_schedule`), so total_s = the parts' sum - hidden_s; 0 for a sequential layer.
  control_s: the layer's collectives that carry no rows (each hop's plan all-gathers its send sizes, the
  statistics' all-reduces), priced from the compiled layer (`cost.program_price`); 0 where not known.
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
  control_s: float = 0.0

  @property
  def total_s(self) -> float:
    parts = self.inter_node_a2a_s + self.intra_node_a2a_s + self.expert_compute_s + self.other_s + self.control_s
    return parts - self.hidden_s

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


def non_moe_flops(
  tokens: int,
  seq_len: int,
  d_model: int,
  d_ff: int,
  layers: int,
  moe_layers: int,
  vocab: int,
  gated: bool = False,
  predicted: int | None = None,
) -> float:
  """Forward FLOPs per device of a micro batch of `tokens` tokens outside the MoE layers: attention
  projections (8 d^2 per token) and scores (4 seq d), the dense FFNs of the layers - moe_layers
  other blocks, and the vocabulary projection (2 d vocab) on `predicted` tokens (None: all; a
  BERT-style MLM head that runs on the masked positions only: those)."""
  predicted = tokens if predicted is None else predicted
  return (
    tokens * layers * (8 * d_model**2 + 4 * seq_len * d_model)
    + predicted * 2 * d_model * vocab
    + (layers - moe_layers) * float(expert_flops(tokens, d_model, d_ff, gated))
  )


def training_step_s(
  non_moe_flops: float, rate: float, moe_layer: Breakdown, moe_layers: int, accumulation: int, sync_s: float
) -> float:
  """Seconds of one optimizer step on a GPU: `accumulation` micro batches, each the forward and
  backward of the non-MoE FLOPs at `rate` (x3: a matmul's backward costs two) and of every MoE layer
  (`moe_layer`: priced with backward=True), then the gradient sync (`collectives.ring`)."""
  return accumulation * (3 * non_moe_flops / rate + moe_layers * moe_layer.total_s) + sync_s


def default_rate(topology: Topology) -> tuple[float, str]:
  """(FLOP/s, source): the topology's datasheet peak times its stated efficiency."""
  peak, eff = topology.peak_flops, topology.compute_efficiency
  return peak.value * eff.value, f"{peak.kind} peak {peak.value / 1e12:g} TFLOP/s x {eff.kind} efficiency {eff.value:g}"


def measured_rate(path, field: str = "tflops", impl: str = "dense_gemm", name: str | None = None) -> tuple[float, str]:
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


def as_row_bytes(bytes_per_row: "float | RowBytes") -> RowBytes:
  """`bytes_per_row` as `RowBytes` (a number: every exchange alike)."""
  return bytes_per_row if isinstance(bytes_per_row, RowBytes) else RowBytes.uniform(float(bytes_per_row))


def price_hops(
  traffic_rows, hops, mesh_shape, bytes_per_row: float, topology: Topology
) -> tuple[collectives.ExchangeCost, ...]:
  """The dispatch exchange of every hop: traffic_rows [hops, A, A] (rows s -> p), hops: the hop axes."""
  traffic_rows = np.asarray(traffic_rows)
  n, m = mesh_shape
  if traffic_rows.ndim != 3 or traffic_rows.shape[1:] != (n * m, n * m) or len(hops) != traffic_rows.shape[0]:
    raise ValueError(
      f"traffic_rows {traffic_rows.shape} must be [hops={len(hops)}, {n * m}, {n * m}] for mesh {mesh_shape}"
    )
  if m > topology["gpus_per_node"]:
    raise ValueError(f"mesh has {m} GPUs per node; topology {topology.name} has {topology['gpus_per_node']:g}")
  return tuple(
    collectives.all_to_all(rows * bytes_per_row, mesh_lib.same_group(hop, n, m), m, topology)
    for rows, hop in zip(traffic_rows, hops)
  )


def price_exchanges(
  traffic_rows, hops, mesh_shape, bytes_per_row: "float | RowBytes", topology: Topology, backward: bool = False
) -> tuple[tuple[collectives.ExchangeCost, ...], ...]:
  """Every exchange of the layer, one tuple per pass (the forward; with `backward`, then the backward): the
  dispatch of every hop at the pass's dispatch bytes per row, then the combine (the rows transposed, hops in
  reverse order) at its combine bytes (`RowBytes.passes`). traffic_rows [hops, A, A] as `price_hops` takes it."""
  rows = np.asarray(traffic_rows)
  back = np.swapaxes(rows, 1, 2)[::-1]
  return tuple(
    price_hops(rows, hops, mesh_shape, wire.dispatch, topology)
    + price_hops(back, hops[::-1], mesh_shape, wire.combine, topology)
    for wire in as_row_bytes(bytes_per_row).passes(backward)
  )


def price_from_traffic(
  traffic_rows,
  hops,
  mesh_shape,
  bytes_per_row: "float | RowBytes",
  flops,
  topology: Topology,
  device_rate: float | tuple[float, str] | None = None,
  *,
  other_flops: float = 0.0,
  non_expert_s: float = 0.0,
  control_s: float = 0.0,
  backward: bool = False,
) -> Breakdown:
  """Prices one MoE layer from the rows its exchanges move and the FLOPs its devices compute.

  traffic_rows: [hops, A, A] rows flat device s sends to p in each hop (the layer's aux['traffic_rows']).
  hops: the H hop axes, e.g. [('node', 'gpu')] (flat), ['gpu', 'node'] (hierarchical),
    ['node', 'gpu'] (bi-level).
  mesh_shape: (n, m). bytes_per_row: a row's bytes in each exchange (`RowBytes`, e.g. `moe.wire.row_bytes`), or one
    number for all of them (d_model * bytes per element).
  flops: forward expert FLOPs per device, a number or [A] (the busiest device sets the time); see
    `expert_flops` and `traffic.rows_processed`.
  device_rate: FLOP/s of one device, or (FLOP/s, source) as `measured_rate` returns;
    None = `default_rate(topology)`.
  other_flops: forward non-expert FLOPs per device (router, combine), priced at the same rate.
  non_expert_s: forward seconds of the memory-bound non-expert phases (`cost.phases`); the backward pays
    them twice more, like the FLOPs.
  control_s: seconds of the layer's collectives that carry no rows (`Breakdown.control_s`), paid once per pass
    through the layer: its backward runs none of its own.
  """
  if device_rate is None:
    device_rate = default_rate(topology)
  rate, rate_source = device_rate if isinstance(device_rate, tuple) else (device_rate, "given")
  passes = price_exchanges(traffic_rows, hops, mesh_shape, bytes_per_row, topology, backward)
  exchanges = [c for one_pass in passes for c in one_pass]
  inter = sum(c.time_s for c in exchanges if c.crosses_nodes)
  intra = sum(c.time_s for c in exchanges if not c.crosses_nodes)
  flops_factor = 3 if backward else 1
  return Breakdown(
    inter_node_a2a_s=inter,
    intra_node_a2a_s=intra,
    expert_compute_s=flops_factor * float(np.max(flops)) / rate,
    other_s=flops_factor * (float(other_flops) / rate + non_expert_s),
    hops=passes[0][: len(hops)],
    device_rate=rate,
    rate_source=rate_source,
    topology=topology.name,
    control_s=control_s,
  )
