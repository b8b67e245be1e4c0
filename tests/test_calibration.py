"""The cost model calibrated on a cluster (moejax.cost.fitted, the sweep's calibration step): the topology's
all-to-all terms recovered from exchanges that moejax.cost.collectives' own model timed on a known topology, with
noise; the exchanges along both axes held out and their errors reported; the timed layer's rate and non-expert cost;
a calibrated sweep's rows beyond the timed meshes labelled extrapolated."""

import dataclasses
import json

import ml_collections
import numpy as np
import pytest

from configs import scaling_default
from moejax.cost import collectives, fitted
from moejax.cost import model as cost_model
from moejax.cost import topology as topology_lib
from moejax.runtime import mesh as mesh_lib
from moejax.study import calibration
from moejax.study.points import Point, validate
from moejax.study.price import model_row, price_point_layer
from moejax.validation import ConfigError

BASE = topology_lib.get("p4d_efa")
TRUTH = topology_lib.custom(
  BASE, name="truth", launch=23e-6, intra_latency=4.1e-6, inter_latency=37e-6, intra_bw=140e9, nic_bw=19e9
)
ROW_BYTES = 2048
MESHES = {"gpu": [(1, 2), (1, 4), (1, 8)], "node": [(2, 4), (4, 4)], "both": [(2, 4), (4, 4)]}


def _timed(truth, meshes=MESHES, noise=0.02, seed=0) -> list[fitted.Exchange]:
  """Every exchange of `meshes` at 4 row counts, timed by `truth`'s all-to-all model (summed here from its terms:
  the slowest device's messages and the busiest link's bytes, not through `Exchange.cost`) with relative noise."""
  rng = np.random.default_rng(seed)
  out = []
  for axis, shapes in meshes.items():
    for n, m in shapes:
      for rows in (4, 64, 1024, 8192):
        group = mesh_lib.same_group(fitted.AXES[axis], n, m)
        cost = collectives.all_to_all(group * float(rows * ROW_BYTES), group, m, truth)
        seconds = (
          truth["launch"]
          + cost.messages_intra * truth["intra_latency"]
          + cost.messages_inter * truth["inter_latency"]
          + max(cost.intra_bytes / truth["intra_bw"], cost.nic_bytes / truth["nic_bw"])
        )
        out.append(fitted.Exchange(axis, n, m, rows, ROW_BYTES, seconds * (1 + noise * rng.standard_normal())))
  return out


def test_fit_recovers_the_terms_that_timed_the_exchanges():
  exchanges = _timed(TRUTH, seed=np.random.SeedSequence().entropy % 2**32)
  topology, fit = fitted.fit_topology(exchanges, BASE, "synthetic")
  assert sorted(fit["fitted"]) == sorted(fitted.TERMS)
  for term in fitted.TERMS:
    assert topology[term] == pytest.approx(TRUTH[term], rel=0.15), term
    assert topology.params()[term].kind == "fitted" and "synthetic" in topology.params()[term].source
  assert fit["rms_relative"] < 0.05 and len(fit["relative_residuals"]) == 4 * 5  # the one-axis exchanges
  # Held out: the exchanges along both axes, whose max() of the NIC's and the links' bytes the fit never saw.
  both = [e for e in exchanges if e.axis == "both"]
  assert [(e["nodes"], e["rows_per_peer"]) for e in fit["held_out"]] == [(e.nodes, e.rows_per_peer) for e in both]
  for e, held in zip(both, fit["held_out"]):
    assert held["measured_s"] == e.median_s
    assert held["error"] == pytest.approx(held["model_s"] / e.median_s - 1)
    assert abs(held["error"]) < 0.15
  # Everything else keeps the base's values.
  assert topology["peak_flops"] == BASE["peak_flops"] and topology["memory_bw"] == BASE["memory_bw"]


def test_held_out_errors_expose_a_model_the_exchanges_do_not_follow():
  """Times whose both-axes exchanges pay the NIC's and the links' bytes one after the other (a sum, where the model
  takes the max) on links slow enough that both matter: the one-axis fit is as good as before, the held-out errors
  are not."""
  truth = topology_lib.custom(TRUTH, intra_bw=8e9)
  exchanges = _timed(truth, noise=0.0)
  summed = []
  for e in exchanges:
    if e.axis == "both":
      cost = e.cost(truth)
      extra = min(cost.intra_bytes / truth["intra_bw"], cost.nic_bytes / truth["nic_bw"])
      e = dataclasses.replace(e, median_s=e.median_s + extra)
    summed.append(e)
  _, fit = fitted.fit_topology(summed, BASE, "summed")
  assert fit["rms_relative"] < 1e-6
  assert min(e["error"] for e in fit["held_out"]) < -0.1  # the model is too fast where the bytes are large


def test_one_group_size_folds_the_launch_into_the_latencies():
  exchanges = _timed(TRUTH, meshes={"gpu": [(1, 4)], "node": [(2, 4)]}, noise=0.0)
  topology, fit = fitted.fit_topology(exchanges, BASE, "one size")
  assert topology["launch"] == 0 and "not separable" in topology.params()["launch"].source
  # the 3 intra-node messages and the launch in one term; the inter-node message absorbs the launch too
  assert topology["intra_latency"] + topology["inter_latency"] == pytest.approx(
    TRUTH["launch"] * (1 / 3 + 1) + TRUTH["intra_latency"] + TRUTH["inter_latency"], rel=0.05
  )
  assert fit["held_out"] == []
  with pytest.raises(ValueError, match="no exchange along one axis"):
    fitted.fit_topology([e for e in _timed(TRUTH, noise=0.0) if e.axis == "both"], BASE, "both only")


def test_a_bench_collectives_record_calibrates_too(tmp_path):
  """'flat' is along both axes on 2 nodes and along 'gpu' on one; 'node_a2a' sends m x rows to each peer; the other
  variants are not all-to-alls of one axis and are left out."""
  results = [
    dict(variant=v, rows_per_peer=r, median_s=1e-3 * r) for v in ("flat", "node_a2a", "two_hop") for r in (1, 4)
  ]
  record = dict(mesh=[2, 4], d=64, dtype="float32", results=results)
  got = fitted.exchanges_from_bench(record)
  assert [(e.axis, e.rows_per_peer, e.row_bytes) for e in got] == [
    ("both", 1, 256),
    ("both", 4, 256),
    ("node", 4, 256),
    ("node", 16, 256),
  ]
  assert {e.axis for e in fitted.exchanges_from_bench(dict(record, mesh=[1, 8]))} == {"gpu", "node"}
  path = tmp_path / "collectives.json"
  path.write_text(json.dumps(dict(record, mesh=[1, 8])))
  calibrated = fitted.load(str(path), BASE)
  assert calibrated.rate is None and calibrated.row_cost is None and calibrated.nodes == 1
  path.write_text("{}")
  with pytest.raises(ValueError, match="neither"):
    fitted.load(str(path), BASE)


def test_the_timed_layer_gives_the_rate_and_the_non_expert_cost():
  layer = dict(
    rows=4096, d_model=256, d_ff=512, gated=True, layer_expert_ms=2.5, layer_other_ms=0.75, itemsize=2, device="cpu"
  )
  (rate, source), row_cost = fitted.layer_terms(layer, "calibration.json")
  assert rate == pytest.approx(3 * 2 * 4096 * 256 * 512 / 2.5e-3)  # three matmuls of 2 FLOPs a multiply-add
  assert float(cost_model.expert_flops(4096, 256, 512, True)) / 2.5e-3 == pytest.approx(rate)
  assert row_cost.seconds_per_byte == pytest.approx(0.75e-3 / (4096 * 256 * 2)) and "measured" in source
  assert fitted.layer_terms(dict(layer, layer_other_ms=-0.1), "x")[1] is None  # the timed phases took it all


def _calibrated_config(path: str) -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.update(nodes=(1, 2, 4), gpus_per_node=(4,), schemes=("flat_dropless",), scalings=("weak",))
  config.calibration.source = path
  return config


def test_a_calibrated_sweep_prices_with_the_fit_and_labels_points_beyond_it_extrapolated(tmp_path):
  exchanges = _timed(TRUTH, meshes={"gpu": [(1, 2), (1, 4)], "node": [(2, 4)], "both": [(2, 4)]})
  layer = dict(
    rows=8192, d_model=512, d_ff=2048, gated=False, layer_expert_ms=40.0, layer_other_ms=5.0, itemsize=2, device="cpu"
  )
  path = tmp_path / "calibration.json"
  path.write_text(json.dumps(dict(exchanges=[dataclasses.asdict(e) for e in exchanges], layer=layer)))
  config = _calibrated_config(str(path))
  validate(config)
  rng = np.random.default_rng()
  labels = {}
  for n in (1, 2, 4):
    traffic = rng.integers(0, 40, (1, 4 * n, 4 * n))
    sim = dict(traffic_rows=traffic.tolist(), rows_per_device=traffic[0].sum(0).tolist(), dropped=0, tokens_per_gpu=128)
    sim["control"] = dict(collectives=[], node_of=[0] * (4 * n))  # a hand-made run: no control collectives
    point = Point("flat_dropless", n, 4, "small", "weak")
    row = model_row(point, config, price_point_layer(sim, point, config))
    labels[n] = row["label"]
    assert row["topology"] == "p4d_efa+fitted"
    assert row["device_tflops"] == pytest.approx(float(cost_model.expert_flops(8192, 512, 2048, False)) / 40e-3 / 1e12)
  assert labels == {1: "modelled", 2: "modelled", 4: "extrapolated"}


@pytest.mark.parametrize(
  "field, value",
  [("calibration.source", "/no/such/record.json"), ("calibration.rows", (4, 0)), ("calibration.rows", ())],
)
def test_calibration_errors_name_their_field(field, value):
  config = _calibrated_config("")
  config.calibration[field.split(".")[1]] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == field and str(value) in str(error.value)


def _timed_config() -> ml_collections.ConfigDict:
  """A sweep whose 1 x 2 and 2 x 2 points this process's simulated CPU devices can time."""
  config = _calibrated_config("measure")
  config.update(nodes=(1, 2), gpus_per_node=(2,))
  config.models.small.update(d_model=16, d_ff=32, layers=2, moe_layers=1, seq_len=8, micro_batch=2, vocab=64)
  config.measure.update(platform="cpu", warmup=1, repeats=1, max_repeats=1, layer_max_repeats=1)
  config.calibration.rows = (2, 8)
  return config


@pytest.mark.slow
def test_the_calibration_step_times_the_plan_once_and_its_record_fits(devices, tmp_path, monkeypatch):
  config = _timed_config()
  path = calibration.measure(config, str(tmp_path))
  record = json.loads(open(path).read())
  assert [(e["axis"], e["nodes"], e["gpus_per_node"], e["rows_per_peer"]) for e in record["exchanges"]] == [
    ("gpu", 1, 2, 2),
    ("gpu", 1, 2, 8),
    ("node", 2, 2, 2),
    ("node", 2, 2, 8),
    ("both", 2, 2, 2),
    ("both", 2, 2, 8),
  ]
  assert all(e["median_s"] > 0 and e["row_bytes"] == 16 * 2 for e in record["exchanges"])  # d 16 in bfloat16
  assert record["layer"]["experts"] == 4 and record["layer"]["rows"] == 2 * 8 * 2  # the 2 x 2 mesh's, top-2
  calibrated = fitted.load(path, topology_lib.get("p4d_efa"))
  assert (calibrated.nodes, calibrated.gpus_per_node) == (2, 2) and len(calibrated.fit["held_out"]) == 2
  monkeypatch.setattr(calibration, "time_exchanges", lambda config: pytest.fail("timed again"))
  assert calibration.measure(config, str(tmp_path)) == path  # the same settings: the record is reused


def test_a_sweep_with_nothing_to_time_cannot_calibrate(devices, tmp_path):
  config = _timed_config()
  config.measure.platform = "gpu"  # none here
  with pytest.raises(ConfigError) as error:
    calibration.measure(config, str(tmp_path))
  assert error.value.field == "calibration.source" and "gpu" in str(error.value)
