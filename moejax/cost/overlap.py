"""One MoE layer's time under the overlap schedules of `MoEConfig.schedule` (Comet, arXiv 2502.19811).

Two resources run at once: the link (exchanges, one after another) and the GPU's matmuls. A piece of
work starts when its inputs are there and its resource is free; the layer ends with its last piece.
Every exchange piece is priced by `collectives` (launch and per-message latency included, so more,
smaller exchanges cost more), every matmul piece by the expert FLOPs at the device rate, corrected for
its size by `GemmCurve`:

  sequential  dispatch, layer0 (x @ w_in [, w_gate]), layer1 (h @ w_out), combine: t = D + G0 + G1 + C.
  chunked     C chunks of the local tokens, each dispatched, computed and combined on its own (Tutel,
              FasterMoE; Comet Sec. 1). Dispatch and combine share the link, so the pipeline's stage is
              max(d + c, g) and t = d + g + c + (C - 1) max(d + c, g), with d, g, c one chunk's dispatch,
              matmuls (at the efficiency of a C-fold smaller GEMM) and combine. C = 1 is sequential.
  comet       (Comet's own pipeline; the layer, moejax.moe.schedule, runs the last hop in two steps,
              own rows then the rest, to keep its buffers bounded, so this is the finer pipeline's
              price) layer0 decomposed by source peer (Comet Sec. 3.1, Fig. 5): the hops before the last run
              whole; the last hop runs one ring step per peer, and the layer0 GEMM of a peer's rows runs
              as soon as they are there, the device's own rows first (GEMMs of ~1/G of the rows). layer1
              decomposed by column blocks of d (Fig. 6): NB = num_chunks GEMMs of d / NB columns, each
              block combined (through every hop) as soon as it is computed:
                f_0 = pre + g0_self;  f_j = max(f_(j-1), pre + s_1 + ... + s_j) + g0_j       (j = 1..G-1)
                e_b = f_(G-1) + g1_1 + ... + g1_b;  t_b = max(e_b, t_(b-1)) + c_b             (b = 1..NB)
              with pre the earlier hops' dispatch, s_j ring step j's exchange, t = t_NB.
              Comet's own kernel gives some SMs to communication (n_c of 132, Sec. 3.2.2); the XLA
              schedule here runs NCCL-style collectives, whose SM use is not priced.

The backward (train=True) runs the same schedule once more with twice the matmul time (data and
weight gradients) and the exchanges reversed: the combine's gradients go out the dispatch's way, the
dispatch's come back, each at its own bytes per row (`wire_lib.RowBytes.backward`: gradients in the combine
dtype); Comet describes no backward.

`hidden_fraction` = 1 - (t - compute) / communication, in [0, 1]: the share of the schedule's own
exchange time that runs under matmuls (0 for sequential), Comet Fig. 11's 'communication latency hidden'.
"""

import dataclasses
import math

import numpy as np

from moejax.cost import collectives, model
from moejax.cost.topology import Topology
from moejax.moe import schedule as schedule_lib
from moejax.moe import wire as wire_lib
from moejax.moe.config import SCHEDULES
from moejax.runtime import mesh as mesh_lib
from moejax.validation import is_int, require

TILE = 128  # Comet Sec. 2.2.1: GEMMs work in tiles, 'exemplified by a 128x128 tile'
HOPPER_SMS = 132  # Comet Sec. 5.1 / Fig. 8: Hopper's 132 SMs, one thread block per SM


@dataclasses.dataclass(frozen=True)
class GemmCurve:
  """Wave model of a grouped GEMM's efficiency: output tiles of TILE x TILE run in waves of `sms` tiles,
  so a GEMM of rows_G [G] rows per group and n columns takes ceil(sum_g ceil(rows_g / tile)
  ceil(n / tile) / sms) waves. efficiency = useful tiles' work / (waves x sms x tile^2). Labelled
  'modelled': the H100 results (benchmarks/results/2026-11-23-h100) time every kernel at 16384 rows
  only, and ceilings.json's GEMMs grow all three dimensions at once, so no rows -> efficiency curve
  can be read off them.
  """

  sms: int = HOPPER_SMS
  tile: int = TILE
  label: str = "modelled"

  def __post_init__(self):
    require(is_int(self.sms), "GemmCurve.sms", self.sms, "a positive int (SMs of the GPU)")
    require(is_int(self.tile), "GemmCurve.tile", self.tile, "a positive int (tile edge in rows/columns)")

  def efficiency(self, rows_G, n: float) -> float:
    rows_G = np.asarray(rows_G, np.float64)
    require(
      rows_G.ndim == 1 and rows_G.size > 0 and np.all(rows_G >= 0),
      "rows_G",
      rows_G.tolist(),
      "a non-empty [G] of rows >= 0 per group",
    )
    require(n > 0, "n", n, "columns > 0")
    tiles = float(np.sum(np.ceil(rows_G / self.tile)) * math.ceil(n / self.tile))
    if tiles == 0:
      return 1.0
    waves = math.ceil(tiles / self.sms)
    return float(rows_G.sum() * n / (waves * self.sms * self.tile**2))


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """The busiest device's work: expert_rows_G [G] rows of each local expert, widths d and f.

  rate: FLOP/s of that device's expert GEMMs at the sequential schedule's sizes (pieces are slower
  by the curve's efficiency ratio, so 'sequential' is exactly FLOPs / rate).
  non_expert_s: the forward's routing, sort, gather and weighted scatter on this device as separate kernels
    (`moejax.cost.phases`); sequential pays it whole, chunked a C-th per chunk, comet none (fused, see phases).
  """

  expert_rows_G: tuple
  d_model: int
  d_ff: int
  gated: bool
  rate: float
  curve: GemmCurve = GemmCurve()
  non_expert_s: float = 0.0

  def __post_init__(self):
    rows = np.asarray(self.expert_rows_G, np.float64)
    require(
      rows.ndim == 1 and rows.size > 0 and np.all(rows >= 0),
      "expert_rows_G",
      self.expert_rows_G,
      "a non-empty [G] of rows >= 0 per local expert",
    )
    for name in ("d_model", "d_ff"):
      require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int")
    require(self.rate > 0 and math.isfinite(self.rate), "rate", self.rate, "FLOP/s > 0")

  def layer0_s(self, fraction: float = 1.0) -> float:
    """x @ w_in (and w_gate) on `fraction` of every expert's rows."""
    width = (2 if self.gated else 1) * self.d_ff
    return self._gemm(fraction, width, self.d_model, width)

  def layer1_s(self, fraction: float = 1.0, column_blocks: int = 1) -> float:
    """h @ w_out[:, one of column_blocks blocks of d] on `fraction` of the rows."""
    return self._gemm(fraction, self.d_model / column_blocks, self.d_ff, self.d_model)

  def _gemm(self, fraction: float, n: float, k: float, full_n: float) -> float:
    """Seconds of `fraction` of the rows times n of full_n columns (contraction k): FLOPs / rate, slowed
    by the piece's efficiency relative to the whole GEMM's."""
    rows = np.asarray(self.expert_rows_G, np.float64)
    flops = 2 * fraction * rows.sum() * n * k
    return flops / self.rate * self.curve.efficiency(rows, full_n) / self.curve.efficiency(fraction * rows, n)


@dataclasses.dataclass(frozen=True)
class Exchanges:
  """The layer's traffic: traffic_rows [hops, A, A] (rows s -> p per hop), its hops, mesh (n, m),
  bytes_per_row (a number, or `wire_lib.RowBytes`: each exchange's) and the topology, as
  `model.price_from_traffic` takes them; `device` the busiest one."""

  traffic_rows: np.ndarray
  hops: tuple
  mesh_shape: tuple
  bytes_per_row: "float | wire_lib.RowBytes"
  topology: Topology
  device: int

  @property
  def row_bytes(self) -> wire_lib.RowBytes:
    return model.as_row_bytes(self.bytes_per_row)

  def passes(self, train: bool) -> tuple["Exchanges", ...]:
    """The forward's exchanges, then with `train` the backward's, whose dispatch and combine are the gradients'
    exchanges in the same directions (`wire_lib.RowBytes.passes`)."""
    return tuple(dataclasses.replace(self, bytes_per_row=wire) for wire in self.row_bytes.passes(train))

  def dispatch(self, scale: float = 1.0) -> list[collectives.ExchangeCost]:
    return list(
      model.price_hops(
        np.asarray(self.traffic_rows) * scale, self.hops, self.mesh_shape, self.row_bytes.dispatch, self.topology
      )
    )

  def combine(self, scale: float = 1.0) -> list[collectives.ExchangeCost]:
    rows = np.swapaxes(np.asarray(self.traffic_rows), 1, 2) * scale
    return list(model.price_hops(rows, self.hops, self.mesh_shape, self.row_bytes.combine, self.topology))[::-1]

  def ring_steps(self) -> tuple[list[collectives.ExchangeCost], np.ndarray]:
    """The last hop as ring steps j = 1..G-1 (every device receives from its j-th previous group member
    at once): their costs, and the rows `device` gets [self, step 1, ..., step G-1]."""
    n, m = self.mesh_shape
    rows_AxA = np.asarray(self.traffic_rows)[-1]
    group_AxA = mesh_lib.same_group(self.hops[-1], n, m)
    members = [np.flatnonzero(row) for row in group_AxA]
    size = len(members[0])
    steps, received = [], [rows_AxA[self.device, self.device]]
    for j in range(1, size):
      shift_AxA = np.zeros_like(group_AxA)
      for s, group in enumerate(members):
        shift_AxA[s, group[(np.searchsorted(group, s) + j) % size]] = True
      steps.append(
        collectives.all_to_all(np.where(shift_AxA, rows_AxA, 0) * self.row_bytes.dispatch, shift_AxA, m, self.topology)
      )
      received.append(rows_AxA[shift_AxA[:, self.device], self.device].sum())
    return steps, np.asarray(received, np.float64)


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
  """time_s of the schedule; communication_s / compute_s: its exchange and matmul pieces added up;
  inter_node_s / intra_node_s: communication_s split by whether a piece crosses nodes."""

  schedule: str
  num_chunks: int
  time_s: float
  communication_s: float
  compute_s: float
  inter_node_s: float
  intra_node_s: float
  gemm_curve: str

  @property
  def hidden_s(self) -> float:
    return self.communication_s + self.compute_s - self.time_s

  @property
  def hidden_fraction(self) -> float:
    if self.communication_s == 0:
      return 0.0
    return float(np.clip(1 - (self.time_s - self.compute_s) / self.communication_s, 0.0, 1.0))

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), hidden_s=self.hidden_s, hidden_fraction=self.hidden_fraction)


def _pass(schedule: schedule_lib.Schedule, chunks: int, ex: Exchanges, shape: LayerShape, compute_scale: float):
  """(time, exchange pieces, matmul seconds) of one pass, by what the schedule splits (`moe.schedule.Schedule`)."""
  if not schedule.overlaps or (schedule.splits_rows and chunks == 1):
    pieces = ex.dispatch() + ex.combine()
    compute = compute_scale * (shape.layer0_s() + shape.layer1_s() + shape.non_expert_s)
    return sum(p.time_s for p in pieces) + compute, pieces, compute
  if schedule.splits_rows:
    dispatch, combine = ex.dispatch(1 / chunks), ex.combine(1 / chunks)
    d, c = sum(p.time_s for p in dispatch), sum(p.time_s for p in combine)
    g = compute_scale * (shape.layer0_s(1 / chunks) + shape.layer1_s(1 / chunks) + shape.non_expert_s / chunks)
    return d + g + c + (chunks - 1) * max(d + c, g), chunks * (dispatch + combine), chunks * g
  # splits_columns (comet): the last hop's ring steps feed layer0, layer1 by column blocks of d
  earlier, (steps, received) = ex.dispatch()[:-1], ex.ring_steps()
  total = received.sum()
  share = received / total if total else np.full(received.shape, 1 / received.size)
  g0 = [compute_scale * shape.layer0_s(f) if f else 0.0 for f in share]
  arrived = sum(p.time_s for p in earlier) + np.concatenate([[0.0], np.cumsum([s.time_s for s in steps])])
  finish = 0.0
  for ready, g in zip(arrived, g0):
    finish = max(finish, ready) + g
  g1 = compute_scale * shape.layer1_s(1.0, chunks)
  combine = ex.combine(1 / chunks)
  c = sum(p.time_s for p in combine)
  done = 0.0
  for b in range(1, chunks + 1):
    done = max(finish + b * g1, done) + c
  return done, earlier + steps + chunks * combine, sum(g0) + chunks * g1


def price_schedule(
  schedule: str, exchanges: Exchanges, shape: LayerShape, num_chunks: int = 1, train: bool = False
) -> ScheduleCost:
  """One layer's forward (train=True: forward and backward) under `schedule` (see the module doc)."""
  require(schedule in SCHEDULES, "schedule", schedule, f"one of {SCHEDULES}")
  require(is_int(num_chunks), "num_chunks", num_chunks, "a positive int")
  kind = schedule_lib.SCHEDULES[schedule]
  require(
    not kind.splits_columns or shape.d_model % num_chunks == 0,
    "num_chunks",
    num_chunks,
    f"a divisor of d_model={shape.d_model} for schedule={schedule!r}",
  )
  time_s, comm, inter, compute = 0.0, 0.0, 0.0, 0.0
  for compute_scale, one_pass in zip((1.0, 2.0), exchanges.passes(train)):
    t, pieces, g = _pass(kind, num_chunks, one_pass, shape, compute_scale)
    time_s += t
    compute += g
    comm += sum(p.time_s for p in pieces)
    inter += sum(p.time_s for p in pieces if p.crosses_nodes)
  return ScheduleCost(
    schedule=schedule,
    num_chunks=num_chunks,
    time_s=time_s,
    communication_s=comm,
    compute_s=compute,
    inter_node_s=inter,
    intra_node_s=comm - inter,
    gemm_curve=f"{shape.curve.label} wave model, {shape.curve.tile}x{shape.curve.tile} tiles, {shape.curve.sms} SMs",
  )
