"""The cluster cost model: hand-computed exchanges, monotonicity, calibration, and real layer traffic."""

import json

import jax
import numpy as np
import pytest

from moejax.cost import calibrate, collectives, model, traffic
from moejax.cost import topology as topology_lib
from moejax.moe import wire as wire_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from tests.helpers import normal, random_params

# Round numbers in arbitrary units, so that every expected time is easy to check by hand.
TOY = topology_lib.custom(
  "p4d_efa",
  name="toy",
  gpus_per_node=8,
  intra_bw=100.0,
  nic_bw=10.0,
  intra_latency=1.0,
  inter_latency=5.0,
  launch=100.0,
  peak_flops=1000.0,
  compute_efficiency=0.5,
)
FLAT = ("node", "gpu")


def _a2a(rows, n, m, hop, bytes_per_row=1.0, topology=TOY):
  return collectives.all_to_all(np.asarray(rows) * bytes_per_row, mesh_lib.same_group(hop, n, m), m, topology)


def test_single_inter_node_message():
  cost = _a2a([[0, 3], [0, 0]], n=2, m=1, hop=FLAT, bytes_per_row=10)
  assert cost.crosses_nodes and cost.messages_inter == 1 and cost.messages_intra == 0
  assert cost.time_s == pytest.approx(100 + 5 + 30 / 10)


def test_single_intra_node_message():
  cost = _a2a([[0, 3], [0, 0]], n=1, m=2, hop=FLAT, bytes_per_row=10)
  assert not cost.crosses_nodes
  assert cost.time_s == pytest.approx(100 + 1 + 30 / 100)


def test_gpus_of_a_node_share_its_nic():
  rows = 6
  one_gpu = _a2a(traffic.uniform_traffic(2, 1, "node", rows), n=2, m=1, hop="node")
  four_gpus = _a2a(traffic.uniform_traffic(2, 4, "node", rows), n=2, m=4, hop="node")
  assert one_gpu.bandwidth_s == pytest.approx(rows / 10)
  assert four_gpus.bandwidth_s == pytest.approx(4 * rows / 10)
  assert four_gpus.nic_bytes == 4 * rows and four_gpus.messages_inter == 1


def test_two_hops_post_fewer_messages_than_one():
  n, m = 4, 8
  flat = _a2a(traffic.uniform_traffic(n, m, FLAT, 1), n, m, FLAT)
  over_nodes = _a2a(traffic.uniform_traffic(n, m, "node", 1), n, m, "node")
  over_gpus = _a2a(traffic.uniform_traffic(n, m, "gpu", 1), n, m, "gpu")
  assert (flat.messages_inter, flat.messages_intra) == ((n - 1) * m, m - 1)
  assert (over_nodes.messages_inter, over_nodes.messages_intra) == (n - 1, 0)
  assert (over_gpus.messages_inter, over_gpus.messages_intra) == (0, m - 1)
  assert flat.latency_s == pytest.approx((n - 1) * m * 5 + (m - 1) * 1)
  assert over_nodes.latency_s + over_gpus.latency_s == pytest.approx((n - 1) * 5 + (m - 1) * 1)


def test_group_of_one_launches_nothing():
  assert _a2a(np.eye(8, dtype=int), n=8, m=1, hop="gpu") == collectives.NOTHING


def test_traffic_outside_the_hop_group_is_rejected():
  rows = np.zeros((8, 8), int)
  rows[0, 5] = 1  # node 0 gpu 0 -> node 1 gpu 1: not in one group of a hop over 'node'
  with pytest.raises(ValueError, match="do not exchange"):
    _a2a(rows, n=2, m=4, hop="node")


def test_more_bytes_take_more_time():
  rows = np.random.default_rng(0).integers(0, 50, (8, 8))
  times = [_a2a(rows * scale, n=2, m=4, hop=FLAT).time_s for scale in (1, 2, 3)]
  assert times[0] < times[1] < times[2]


def test_more_nodes_with_fixed_bytes_per_gpu_post_more_inter_node_messages():
  m, rows_per_gpu = 8, 4096
  costs = [_a2a(traffic.uniform_traffic(n, m, FLAT, rows_per_gpu // (n * m)), n, m, FLAT) for n in (1, 2, 4, 8)]
  inter = [c.messages_inter for c in costs]
  assert inter == sorted(inter) and len(set(inter)) == len(inter)
  times = [c.time_s for c in costs]
  assert times == sorted(times)


def test_ring_collectives_by_hand():
  size = 40.0
  one_node = collectives.ring("all_reduce", size, nodes=1, gpus=4, topology=TOY)
  assert one_node.time_s == pytest.approx(100 + 2 * 3 * 1 + 2 * 3 / 4 * size / 100)
  two_nodes = collectives.ring("all_gather", size, nodes=2, gpus=4, topology=TOY)
  assert two_nodes.time_s == pytest.approx(100 + 6 * 1 + 1 * 5 + 7 / 8 * size / 10)
  shared = collectives.ring("reduce_scatter", size, nodes=2, gpus=1, topology=TOY, concurrent=4)
  assert shared.bandwidth_s == pytest.approx(size / 2 / (10 / 4))


def test_calibration_recovers_latency_and_bandwidth():
  sizes = np.geomspace(1e3, 1e8, 12)
  noise = 1 + 0.01 * np.sin(np.arange(12))
  lb = calibrate.fit_latency_bandwidth(sizes, (7e-6 + sizes / 12e9) * noise)
  assert lb.physical
  assert lb.latency_s == pytest.approx(7e-6, rel=0.05)
  assert lb.bandwidth == pytest.approx(12e9, rel=0.02)
  assert lb.fit.dof == 10 and lb.fit.rms_relative < 0.02


def test_calibration_fits_several_terms_exactly_and_refuses_too_few_points():
  features = np.array([[120, 3e8], [15, 3e8], [60, 1e8]])
  fit = calibrate.fit_terms(features, features @ np.array([2e-4, 1 / 2e10]), ("per_message_s", "s_per_byte"))
  assert fit.values["per_message_s"] == pytest.approx(2e-4)
  assert fit.values["s_per_byte"] == pytest.approx(1 / 2e10)
  assert max(map(abs, fit.residuals_s)) < 1e-12
  with pytest.raises(ValueError, match="cannot determine"):
    calibrate.fit_terms(features[:1], [1.0], ("a", "b"))


def test_presets_cite_a_source_for_every_number():
  for preset in topology_lib.PRESETS.values():
    for field, param in preset.params().items():
      assert param.kind in topology_lib.KINDS and len(param.source) > 10, (preset.name, field)
      if param.kind == "assumed":
        assert "assumed" in param.source or "constant" in param.source, (preset.name, field)
  assert topology_lib.get("dgx_h100_ib")["nic_bw"] == 400e9
  custom = topology_lib.custom("p4d_efa", **topology_lib.parse_overrides("nic_bw=25e9, inter_latency=2e-5"))
  assert custom.nic_bw.kind == "given" and custom["nic_bw"] == 25e9 and custom.intra_bw.kind == "datasheet"
  with pytest.raises(ValueError, match="unknown topology field"):
    topology_lib.custom("p4d_efa", nic_speed=1.0)


def test_measured_rate_from_a_benchmark_json(tmp_path):
  path = tmp_path / "kernels.json"
  results = [
    dict(impl="dense_gemm", tflops=600.0),
    dict(impl="dense_gemm", tflops=650.0),
    dict(impl="pallas", tflops=500.0),
  ]
  path.write_text(json.dumps(dict(device_kind="H100", results=results)))
  rate, source = model.measured_rate(str(path))
  assert rate == 650e12 and "measured" in source and "H100" in source
  assert model.measured_rate(str(path), impl="pallas")[0] == 500e12
  assert model.measured_rate(path, name="results/kernels.json")[1].startswith("measured: results/kernels.json max")
  breakdown = model.price_from_traffic(
    np.zeros((1, 1, 1), int), [FLAT], (1, 1), 2, 1.3e15, TOY, device_rate=(rate, source)
  )
  assert breakdown.expert_compute_s == pytest.approx(2.0) and breakdown.rate_source == source


def test_price_from_traffic_splits_hops_by_the_links_they_cross():
  n, m = 2, 4
  rows = np.stack([traffic.uniform_traffic(n, m, "gpu", 3), traffic.uniform_traffic(n, m, "node", 5)])
  b = model.price_from_traffic(rows, ["gpu", "node"], (n, m), 2.0, 1000.0, TOY, other_flops=500.0)
  intra, inter = _a2a(rows[0], n, m, "gpu", 2.0), _a2a(rows[1], n, m, "node", 2.0)
  assert b.intra_node_a2a_s == pytest.approx(2 * intra.time_s)
  assert b.inter_node_a2a_s == pytest.approx(2 * inter.time_s)
  assert (b.expert_compute_s, b.other_s) == (pytest.approx(2.0), pytest.approx(1.0))
  trained = model.price_from_traffic(rows, ["gpu", "node"], (n, m), 2.0, 1000.0, TOY, backward=True)
  assert trained.inter_node_a2a_s == pytest.approx(2 * b.inter_node_a2a_s)
  assert trained.expert_compute_s == pytest.approx(3 * b.expert_compute_s)
  with pytest.raises(ValueError, match="GPUs per node"):
    model.price_from_traffic(np.zeros((1, 16, 16), int), [FLAT], (1, 16), 2.0, 0.0, TOY)


def _hand_hop_time(rows, hop, n, m, bytes_per_row, topo):
  """The all-to-all formula written out with loops over devices, independent of the vectorised code."""
  axes = set((hop,) if isinstance(hop, str) else hop)
  devices = range(n * m)

  def grouped(s, p):
    return (s // m == p // m or "node" in axes) and (s % m == p % m or "gpu" in axes)

  latency = max(
    sum(
      topo["inter_latency"] if s // m != p // m else topo["intra_latency"] for p in devices if p != s and grouped(s, p)
    )
    for s in devices
  )
  nic_out = [sum(rows[s][p] for s in devices for p in devices if s // m == i and p // m != i) for i in range(n)]
  nic_in = [sum(rows[s][p] for s in devices for p in devices if p // m == i and s // m != i) for i in range(n)]
  gpu_out = [sum(rows[s][p] for p in devices if p != s and p // m == s // m) for s in devices]
  gpu_in = [sum(rows[s][p] for s in devices if s != p and s // m == p // m) for p in devices]
  bandwidth = max(
    max(nic_out + nic_in) * bytes_per_row / topo["nic_bw"], max(gpu_out + gpu_in) * bytes_per_row / topo["intra_bw"]
  )
  return topo["launch"] + latency + bandwidth


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("path,hops", [("flat", [FLAT]), ("gpu_first", ["gpu", "node"])])
def test_prices_real_traffic_from_the_layer(mesh_2x4, path, hops, dedup):
  """The layer's traffic priced hop by hop; the experts' work is the choices they processed: the rows that
  arrive without dedup, fewer rows (each with several choices) with it."""
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=16, path=path, dedup=dedup)
  params = random_params(cfg, 0)
  x = normal(1, (64, 8))
  _, aux = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(params, x)
  rows = np.asarray(aux["traffic_rows"])
  rows_A, choices_A = traffic.rows_processed(rows), np.asarray(aux["expert_counts"]).reshape(8, 2).sum(axis=1)
  if dedup:
    assert (rows_A <= choices_A).all() and rows_A.sum() < choices_A.sum()
  else:
    np.testing.assert_array_equal(rows_A, choices_A)
  rows_A = choices_A
  topo = topology_lib.P4D_EFA
  b = model.price_from_traffic(rows, hops, (2, 4), 8 * 2, model.expert_flops(rows_A, 8, 16), topo)
  hand = [
    _hand_hop_time(r.tolist(), hop, 2, 4, 16, topo) + _hand_hop_time(r.T.tolist(), hop, 2, 4, 16, topo)
    for r, hop in zip(rows, hops)
  ]
  crosses = [hop != "gpu" for hop in hops]
  assert b.inter_node_a2a_s == pytest.approx(sum(t for t, c in zip(hand, crosses) if c), rel=1e-12)
  assert b.intra_node_a2a_s == pytest.approx(sum(t for t, c in zip(hand, crosses) if not c), rel=1e-12)
  assert b.expert_compute_s == pytest.approx(2 * 2 * rows_A.max() * 8 * 16 / (312e12 * 0.5))
  assert b.label == "modelled"


@pytest.mark.parametrize(
  "fields",
  [
    dict(path="gpu_first", dedup=True, dispatch_dtype="float8_e4m3fn", combine_dtype="bfloat16"),
    dict(path="node_first", routing="node_limited", num_nodes=2, dedup=False),
    dict(collective="padded", dedup=True, dispatch_dtype="bfloat16", buffer_factor=2.0),
  ],
)
def test_row_bytes_price_what_the_layer_counts(mesh_2x4, fields):
  """A row's bytes each way, times the layer's rows (out, and back transposed), are the layer's own traffic_bytes:
  payload in the dispatch dtype with FP8's scales and the slots' ids and weights out, the result in the combine
  dtype (float32 if None) and, where a hop may drop, the arrival flags back."""
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=200, d_ff=16, **fields)
  params = random_params(cfg, 0)
  x = normal(1, (64, 200))  # float32 activations: 4 bytes per element
  _, aux = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4))(params, x)
  rows = np.asarray(aux["traffic_rows"], np.float64)
  wire = wire_lib.row_bytes(
    200, 2 if cfg.deduplicates else 1, 4, cfg.dispatch_dtype, cfg.combine_dtype, may_drop=cfg.buffer_factor is not None
  )
  np.testing.assert_allclose(
    rows * wire.dispatch + np.swapaxes(rows, 1, 2) * wire.combine, np.asarray(aux["traffic_bytes"]), rtol=1e-6
  )


def test_row_bytes_by_hand():
  d, slots = 300, 3  # FP8: 300 bytes and a float32 scale for each of 3 blocks of 128
  fp8 = wire_lib.row_bytes(d, slots, 2, "float8_e4m3fn", "bfloat16", may_drop=True)
  assert fp8 == wire_lib.RowBytes(
    dispatch=300 + 3 * 4 + 3 * 8, combine=600 + 3 * 4, dispatch_grad=600 + 3 * 4, combine_grad=600
  )
  plain = wire_lib.row_bytes(d, 1, 2)  # None: the activations' bf16 out, float32 results back and their grads
  assert plain == wire_lib.RowBytes(dispatch=600 + 8, combine=1200, dispatch_grad=600 + 4, combine_grad=1200)
  assert fp8.backward.backward == fp8 and model.as_row_bytes(5) == wire_lib.RowBytes(5.0, 5.0, 5.0, 5.0)


def test_each_exchange_is_priced_at_its_own_bytes_forward_and_backward():
  """The dispatch at the dispatch's bytes, the combine (transposed) at the combine's; the backward sends the
  combine's gradients the dispatch's way and the dispatch's back, each at its own bytes."""
  n, m, hops = 2, 4, ["node", "gpu"]
  rng = np.random.default_rng(0)
  rows = np.stack([np.where(mesh_lib.same_group(h, n, m), rng.integers(0, 50, (8, 8)), 0) for h in hops])
  wire = wire_lib.RowBytes(dispatch=3.0, combine=5.0, dispatch_grad=7.0, combine_grad=11.0)
  b = model.price_from_traffic(rows, hops, (n, m), wire, 0.0, topology_lib.P4D_EFA)
  t = model.price_from_traffic(rows, hops, (n, m), wire, 0.0, topology_lib.P4D_EFA, backward=True)

  def hand(out_bytes, back_bytes):
    times = [
      (
        _hand_hop_time(r.tolist(), h, n, m, out_bytes, topology_lib.P4D_EFA)
        + _hand_hop_time(r.T.tolist(), h, n, m, back_bytes, topology_lib.P4D_EFA)
      )
      for r, h in zip(rows, hops)
    ]
    return times[0], times[1]  # 'node' crosses nodes, 'gpu' stays inside

  inter, intra = hand(3.0, 5.0)
  assert (b.inter_node_a2a_s, b.intra_node_a2a_s) == (pytest.approx(inter, rel=1e-12), pytest.approx(intra, rel=1e-12))
  grad_inter, grad_intra = hand(11.0, 7.0)
  assert t.inter_node_a2a_s == pytest.approx(inter + grad_inter, rel=1e-12)
  assert t.intra_node_a2a_s == pytest.approx(intra + grad_intra, rel=1e-12)
  assert [h.nic_bytes for h in b.hops] == [
    h.nic_bytes for h in model.price_hops(rows, hops, (n, m), 3.0, topology_lib.P4D_EFA)
  ]
  uniform = wire_lib.RowBytes.uniform(4.0)
  same = [
    model.price_from_traffic(rows, hops, (n, m), w, 0.0, topology_lib.P4D_EFA, backward=True).total_s
    for w in (uniform, 4.0)
  ]
  assert same[0] == same[1]


def test_non_moe_flops_match_xla_count_of_the_bert_forward():
  """The step model's FLOPs outside the MoE layers, against XLA's own count of the BERT-MoE model's
  forward without MoE layers (elementwise work, which the formula leaves out, is a few percent)."""
  from flax import nnx

  from moejax.models.config import ModelConfig
  from moejax.models.state import abstract_state
  from moejax.runtime import mesh as mesh_lib

  b, seq, predicted, d, f, layers, vocab = 4, 32, 5, 128, 512, 2, 512
  # Unrolled layers: XLA's cost analysis counts a scan's body once, not once per iteration, so the scanned
  # default (model.scan_layers=True) would report one layer's FLOPs for all of them.
  cfg = ModelConfig(
    kind="bert",
    vocab_size=vocab,
    num_layers=layers,
    d_model=d,
    num_heads=2,
    d_ff=f,
    max_len=seq,
    dropout=0.0,
    moe_every=0,
    scan_layers=False,
  )
  moe_cfg = MoEConfig(num_experts=1, top_k=1, d_model=d, d_ff=f)
  graphdef, params, rest = abstract_state(cfg, moe_cfg, mesh_lib.make_mesh(1, 1))
  forward = lambda p, r, tokens, positions: nnx.merge(graphdef, p, r)(tokens, positions_BxP=positions)[0]
  compiled = (
    jax.jit(forward)
    .lower(params, rest, jax.ShapeDtypeStruct((b, seq), np.int32), jax.ShapeDtypeStruct((b, predicted), np.int32))
    .compile()
  )
  cost = compiled.cost_analysis()
  xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  want = model.non_moe_flops(b * seq, seq, d, f, layers, 0, vocab, predicted=b * predicted)
  assert want <= xla_flops < 1.1 * want, (xla_flops, want)


def test_training_step_by_hand():
  layer = model.Breakdown(
    inter_node_a2a_s=1.0,
    intra_node_a2a_s=0.5,
    expert_compute_s=2.0,
    other_s=0.5,
    hops=(),
    device_rate=1.0,
    rate_source="given",
    topology="toy",
  )
  # 3 micro batches of (3 x 100 FLOPs at 10 FLOP/s + 2 layers x 4 s), then 7 s of gradient sync.
  assert model.training_step_s(100.0, 10.0, layer, 2, 3, 7.0) == pytest.approx(3 * (30.0 + 8.0) + 7.0)
