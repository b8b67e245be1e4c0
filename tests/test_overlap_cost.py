"""Overlap schedules' prices (moejax.cost.overlap) against hand computations of the module's equations."""

import dataclasses
import math

import numpy as np
import pytest

from moejax.cost import model, overlap, traffic
from moejax.cost import topology as topology_lib
from moejax.moe import wire as wire_lib
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError

LAUNCH, LAT, BW = 7.0, 0.5, 40.0
TOY = topology_lib.custom(
  "h800_nvlink",
  name="toy",
  gpus_per_node=8,
  intra_bw=BW,
  nic_bw=10.0,
  intra_latency=LAT,
  inter_latency=3.0,
  launch=LAUNCH,
  peak_flops=1.0,
  compute_efficiency=1.0,
)


def hand_efficiency(rows, n, tile=128, sms=132):
  tiles = 0
  for r in rows:
    tiles += math.ceil(r / tile) * math.ceil(n / tile)
  waves = math.ceil(tiles / sms)
  return sum(rows) * n / (waves * sms * tile * tile)


def toy_layer(rng, gpus=8, gated=False):
  """A one-node flat layer with uniform traffic of random size and random widths (float64 throughout)."""
  per_peer = int(rng.integers(20, 400))
  rows = traffic.uniform_traffic(1, gpus, mesh_lib.AXES, per_peer)[None]
  bytes_per_row = float(rng.uniform(1, 50))
  d = 128 * int(rng.integers(1, 9))
  f = int(rng.integers(100, 3000))
  # Matmuls from a tenth to ten times the exchanges, so both communication- and compute-bound stages occur.
  flops = 2 * per_peer * gpus * ((2 if gated else 1) * f * d + d * f)
  exchanges = 2 * (LAUNCH + 7 * LAT + 7 * per_peer * bytes_per_row / BW)
  rate = flops / (exchanges * float(10 ** rng.uniform(-1, 1)))
  ex = overlap.Exchanges(rows, (mesh_lib.AXES,), (1, gpus), bytes_per_row, TOY, device=0)
  shape = overlap.LayerShape((per_peer * gpus,), d, f, gated, rate)
  return ex, shape, per_peer, bytes_per_row


def hand_gemm(rows, fraction, n, k, full_n, rate):
  """Seconds of a GEMM piece: FLOPs / rate x efficiency(whole) / efficiency(piece)."""
  return 2 * fraction * rows * n * k / rate * hand_efficiency([rows], full_n) / hand_efficiency([fraction * rows], n)


def test_wave_efficiency_matches_hand_count():
  rng = np.random.default_rng(0)
  curve = overlap.GemmCurve()
  for _ in range(20):
    rows = rng.integers(0, 5000, size=int(rng.integers(1, 9))).astype(float)
    rows[0] += 1
    n = float(rng.integers(1, 20000))
    assert curve.efficiency(rows, n) == pytest.approx(hand_efficiency(rows, n), rel=1e-12)
  assert curve.efficiency([128 * 132], 128) == pytest.approx(1.0)  # exactly one full wave
  assert curve.efficiency([129], 128) == pytest.approx(129 / (132 * 128))  # two row tiles, one wave


@pytest.mark.parametrize("seed", range(8))
def test_sequential_and_chunked_match_the_pipeline_formula(seed):
  rng = np.random.default_rng(seed)
  ex, shape, per_peer, bpr = toy_layer(rng, gated=bool(seed % 2))
  rows, d, f = per_peer * 8, shape.d_model, shape.d_ff
  width = (2 if shape.gated else 1) * f

  def exchange(scale):  # one all-to-all on one node: launch + 7 messages + the busiest GPU's remote bytes
    return LAUNCH + 7 * LAT + 7 * per_peer * scale * bpr / BW

  def gemms(fraction):
    return hand_gemm(rows, fraction, width, d, width, shape.rate) + hand_gemm(rows, fraction, d, f, d, shape.rate)

  seq = overlap.price_schedule("sequential", ex, shape)
  assert seq.time_s == pytest.approx(2 * exchange(1) + gemms(1), rel=1e-12)
  assert seq.hidden_fraction == pytest.approx(0.0, abs=1e-12)
  for c in (1, 2, 3, 8):
    dc, gc = exchange(1 / c), gemms(1 / c)
    got = overlap.price_schedule("chunked", ex, shape, c)
    assert got.time_s == pytest.approx(2 * dc + gc + (c - 1) * max(2 * dc, gc), rel=1e-12)
    assert got.communication_s == pytest.approx(2 * c * dc, rel=1e-12)
    assert got.compute_s == pytest.approx(c * gc, rel=1e-12)
  one = overlap.price_schedule("chunked", ex, shape, 1)
  assert one.time_s == seq.time_s and one.communication_s == seq.communication_s


@pytest.mark.parametrize("seed", range(8))
def test_comet_matches_the_ring_and_column_block_recurrences(seed):
  rng = np.random.default_rng(10 + seed)
  ex, shape, per_peer, bpr = toy_layer(rng)
  rows, d, f = per_peer * 8, shape.d_model, shape.d_ff
  step = LAUNCH + LAT + per_peer * bpr / BW  # one ring step: one message of one peer's rows per GPU
  g0 = hand_gemm(rows, 1 / 8, f, d, f, shape.rate)  # every source sends the same rows
  for blocks in (1, 2, 4):
    if d % blocks:
      continue
    finish = g0  # own rows first, at time 0
    for j in range(1, 8):
      finish = max(finish, j * step) + g0
    g1 = hand_gemm(rows, 1.0, d / blocks, f, d, shape.rate)
    c = LAUNCH + 7 * LAT + 7 * per_peer * bpr / blocks / BW
    done = 0.0
    for b in range(1, blocks + 1):
      done = max(finish + b * g1, done) + c
    got = overlap.price_schedule("comet", ex, shape, blocks)
    assert got.time_s == pytest.approx(done, rel=1e-12)
    assert got.communication_s == pytest.approx(7 * step + blocks * c, rel=1e-12)
    assert got.compute_s == pytest.approx(8 * g0 + blocks * g1, rel=1e-12)
    hidden = 1 - (done - got.compute_s) / got.communication_s
    assert got.hidden_fraction == pytest.approx(min(max(hidden, 0), 1), abs=1e-12)


def test_training_adds_a_backward_with_twice_the_matmuls():
  ex, shape, _, _ = toy_layer(np.random.default_rng(3))
  for schedule, chunks in (("sequential", 1), ("chunked", 4), ("comet", 2)):
    fwd = overlap.price_schedule(schedule, ex, shape, chunks)
    doubled = overlap.LayerShape(shape.expert_rows_G, shape.d_model, shape.d_ff, shape.gated, shape.rate / 2)
    bwd = overlap.price_schedule(schedule, ex, doubled, chunks)
    train = overlap.price_schedule(schedule, ex, shape, chunks, train=True)
    assert train.time_s == pytest.approx(fwd.time_s + bwd.time_s, rel=1e-12)


def test_each_pass_prices_its_own_bytes_per_row():
  """With a row's bytes per exchange (`wire_lib.RowBytes`), the sequential schedule's exchanges are those of
  `model.price_from_traffic`: the forward's dispatch and combine at their bytes, the backward's at the gradients';
  the chunked schedule's chunks and comet's ring steps and column blocks at their pass's bytes too."""
  rows = traffic.uniform_traffic(2, 4, mesh_lib.AXES, 30)[None]
  wire = wire_lib.RowBytes(dispatch=100.0, combine=300.0, dispatch_grad=500.0, combine_grad=700.0)
  topology = topology_lib.P4D_EFA
  ex = overlap.Exchanges(rows, (mesh_lib.AXES,), (2, 4), wire, topology, device=0)
  shape = overlap.LayerShape((240.0,), 256, 512, False, 1e14)
  for train in (False, True):
    want = model.price_from_traffic(rows, (mesh_lib.AXES,), (2, 4), wire, 0.0, topology, backward=train)
    got = overlap.price_schedule("sequential", ex, shape, train=train)
    assert got.inter_node_s == pytest.approx(want.inter_node_a2a_s, rel=1e-12)
    assert got.intra_node_s == pytest.approx(want.intra_node_a2a_s, rel=1e-12)
  for schedule, chunks in (("chunked", 4), ("comet", 2)):
    pieces = [
      overlap.price_schedule(schedule, dataclasses.replace(ex, bytes_per_row=w), shape, chunks)
      for w in (wire, wire.backward)
    ]
    doubled = dataclasses.replace(shape, rate=shape.rate / 2)
    backward = overlap.price_schedule(schedule, dataclasses.replace(ex, bytes_per_row=wire.backward), doubled, chunks)
    train = overlap.price_schedule(schedule, ex, shape, chunks, train=True)
    assert train.time_s == pytest.approx(pieces[0].time_s + backward.time_s, rel=1e-12)
    assert pieces[1].communication_s > pieces[0].communication_s  # the gradients' rows are the heavier here
  same = [
    overlap.price_schedule("comet", dataclasses.replace(ex, bytes_per_row=b), shape, 2, train=True).time_s
    for b in (64.0, wire_lib.RowBytes.uniform(64.0))
  ]
  assert same[0] == same[1]


def test_without_communication_every_schedule_is_its_matmuls():
  rows = np.full((1, 1, 1), 1000)
  ex = overlap.Exchanges(rows, (mesh_lib.AXES,), (1, 1), 64.0, TOY, device=0)
  shape = overlap.LayerShape((1000,), 256, 512, False, 1e4)
  for schedule, chunks in (("sequential", 1), ("chunked", 4), ("comet", 4)):
    got = overlap.price_schedule(schedule, ex, shape, chunks)
    assert got.communication_s == 0 and got.hidden_fraction == 0
    assert got.time_s == pytest.approx(got.compute_s, rel=1e-12)


def test_comet_hides_more_than_chunked_when_compute_bound_on_a_real_preset():
  """8 x H800, Mixtral's widths, 2048 rows per expert: both pipelines hide most exchanges, sequential none."""
  rows = traffic.uniform_traffic(1, 8, mesh_lib.AXES, 256)[None]
  ex = overlap.Exchanges(rows, (mesh_lib.AXES,), (1, 8), 4096 * 2, topology_lib.H800_NVLINK, device=0)
  shape = overlap.LayerShape((2048,), 4096, 14336, True, 7e14)
  seq = overlap.price_schedule("sequential", ex, shape)
  comet = overlap.price_schedule("comet", ex, shape, 4)
  assert comet.time_s < seq.time_s
  assert 0.5 < comet.hidden_fraction <= 1


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(schedule="pipelined"), "schedule"),
    (dict(num_chunks=0), "num_chunks"),
    (dict(schedule="comet", num_chunks=3), "num_chunks"),
  ],
)
def test_bad_schedule_arguments_name_their_field(kwargs, field):
  ex, shape, _, _ = toy_layer(np.random.default_rng(5))
  args = dict(schedule="chunked", num_chunks=2) | kwargs
  with pytest.raises(ConfigError, match=field):
    overlap.price_schedule(args["schedule"], ex, shape, args["num_chunks"])


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(expert_rows_G=(-1.0,)), "expert_rows_G"),
    (dict(d_model=0), "d_model"),
    (dict(rate=0.0), "rate"),
  ],
)
def test_bad_layer_shapes_name_their_field(kwargs, field):
  args = dict(expert_rows_G=(10.0,), d_model=128, d_ff=256, gated=False, rate=1.0) | kwargs
  with pytest.raises(ConfigError, match=field):
    overlap.LayerShape(**args)
  with pytest.raises(ConfigError, match="sms"):
    overlap.GemmCurve(sms=0)


def test_non_expert_phases_are_paid_by_the_baselines_not_by_comet(tmp_path):
  """A synthetic phase_timing record: 0.5 ms of 'other' on 1024 rows of d 256 (bf16) is 0.5e-3 / (1024 * 256 * 2)
  seconds per byte; sequential pays it whole, chunked pays it once over its chunks, comet not at all."""
  import json

  from moejax.cost import phases

  record = {
    "device": "GPU X",
    "cases": [
      {
        "model": "m",
        "collective": "padded",
        "expert_backend": b,
        "rows": 1024,
        "d_model": 256,
        "phases_ms": {"layer_other_ms": other},
      }
      for b, other in (("a", 0.4), ("b", 0.6))
    ],
  }
  (tmp_path / "layer.json").write_text(json.dumps(record))
  cost = phases.from_layer_json(tmp_path / "layer.json", "m")
  assert cost.seconds_per_byte == pytest.approx(0.5e-3 / (1024 * 256 * 2))
  assert cost.seconds(2048, 256) == pytest.approx(1e-3)
  with pytest.raises(ValueError):
    phases.from_layer_json(tmp_path / "layer.json", "m", collective="ragged")

  rows = traffic.uniform_traffic(1, 4, mesh_lib.AXES, 64)[None]
  ex = overlap.Exchanges(rows, (mesh_lib.AXES,), (1, 4), 256 * 2, topology_lib.H800_NVLINK, device=0)
  base = overlap.LayerShape((256.0,), 256, 1024, gated=False, rate=1e14)
  extra = dataclasses.replace(base, non_expert_s=1e-3)
  for schedule, chunks in (("sequential", 1), ("chunked", 4)):
    delta = (
      overlap.price_schedule(schedule, ex, extra, chunks).compute_s
      - overlap.price_schedule(schedule, ex, base, chunks).compute_s
    )
    assert delta == pytest.approx(1e-3)
  assert overlap.price_schedule("comet", ex, extra, 2).time_s == overlap.price_schedule("comet", ex, base, 2).time_s


def test_the_measured_row_cost_is_the_committed_h100_runs_and_scales_with_memory_bandwidth():
  from moejax.cost import phases
  from tests.helpers import ROOT

  got = phases.from_layer_json(ROOT / phases.H100_LAYER_JSON, "mixtral_8x7b")
  assert phases.H100_MEASURED.seconds_per_byte == pytest.approx(got.seconds_per_byte, rel=1e-12)
  assert phases.for_topology(topology_lib.DGX_H100_IB) == phases.H100_MEASURED  # the same HBM3
  l20 = phases.for_topology(topology_lib.L20_PCIE)
  assert l20.seconds_per_byte == pytest.approx(got.seconds_per_byte * 3.35e12 / 864e9)
  assert "memory bandwidth" in l20.source
