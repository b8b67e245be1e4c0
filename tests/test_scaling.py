"""The scaling sweep: end to end on a tiny config, resuming, scaling definitions, config errors."""

import csv
import json
import os
import shutil

import ml_collections
import numpy as np
import pytest

from configs import scaling_default
from moejax.cost import collectives
from moejax.cost import topology as topology_lib
from moejax.runtime import mesh as mesh_lib
from moejax.study import report
from moejax.study.inputs import balanced_routers
from moejax.study.points import Point, scheme_config, simulation_key, validate
from moejax.study.price import price_point_layer
from moejax.study.store import POINTS_FILE, SIMULATIONS_FILE, load_jsonl
from moejax.study.sweep import run
from moejax.validation import ConfigError

# slow: scaling sweeps end to end; one xdist worker runs the module, so its module fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("scaling")]

SCHEMES = 7  # the default sweep's: five routings, two of them also without dedup
POINTS = SCHEMES * 2 * 2  # schemes x meshes x scalings (one model)


def tiny_config() -> ml_collections.ConfigDict:
  config = scaling_default.get_config()
  config.nodes = (1, 2)
  config.gpus_per_node = (2,)
  config.global_batch = 16
  config.models = ml_collections.ConfigDict(
    {"tiny": {"d_model": 32, "d_ff": 64, "layers": 2, "moe_layers": 1, "seq_len": 8, "micro_batch": 4, "vocab": 100}}
  )
  config.sim.update({"tokens_per_gpu": 8, "batches": 2, "d_model": 16, "d_ff": 32})
  return config


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, devices):
  workdir = str(tmp_path_factory.mktemp("scaling"))
  rows, counts = run(tiny_config(), workdir)
  return workdir, rows, counts


def test_sweep_writes_csv_json_and_the_plots(sweep):
  workdir, rows, counts = sweep
  assert counts == {"computed": POINTS, "skipped": 0, "simulated": SCHEMES * 2}
  paths = report.write_all(rows, tiny_config(), workdir)
  assert sorted(os.path.basename(p) for p in paths.values()) == [
    "breakdown.png",
    "efficiency.png",
    "results.csv",
    "results.json",
    "throughput.png",
  ]
  for path in paths.values():
    assert os.path.getsize(path) > 0
  with open(paths["results.csv"]) as f:
    assert len(list(csv.DictReader(f))) == POINTS
  with open(paths["results.json"]) as f:
    assert len(json.load(f)["rows"]) == POINTS
  assert "switch" in report.comparison_table(rows)


def test_rows_are_modelled_with_positive_times(sweep):
  _, rows, _ = sweep
  assert {r["label"] for r in rows} == {"modelled"}
  assert all(r["layer_ms"] > 0 and r["samples_per_s"] > 0 for r in rows)
  one_node = [r for r in rows if r["nodes"] == 1]
  assert all(r["layer_inter_node_ms"] == 0 and r["inter_node_mb_per_gpu"] == 0 for r in one_node)
  assert all(r["layer_inter_node_ms"] > 0 for r in rows if r["nodes"] == 2)


def test_rerun_skips_finished_points_and_reprices_without_rerunning_the_layer(sweep):
  workdir, rows, _ = sweep
  again, counts = run(tiny_config(), workdir)
  assert counts == {"computed": 0, "skipped": POINTS, "simulated": 0}
  assert again == rows
  config = tiny_config()
  config.global_batch = 32  # changes the strong-scaling points only
  _, counts = run(config, workdir)
  assert counts == {"computed": POINTS // 2, "skipped": POINTS // 2, "simulated": 0}
  path = os.path.join(workdir, POINTS_FILE)
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(text[:-20])  # a run interrupted while writing its last point
  _, counts = run(config, workdir)
  assert counts == {"computed": 1, "skipped": POINTS - 1, "simulated": 0}
  assert len(load_jsonl(path)) == POINTS + POINTS // 2


def test_weak_and_strong_scaling_follow_smile_definitions(sweep):
  _, rows, _ = sweep
  config = tiny_config()
  micro, tokens = config.models.tiny.micro_batch, config.models.tiny.micro_batch * config.models.tiny.seq_len
  for r in rows:
    assert r["tokens_per_gpu"] == tokens  # the layer always sees one micro batch per GPU
    per_gpu = r["global_batch"] / r["devices"]
    if r["scaling"] == "weak":  # fixed per-GPU batch: the global batch grows with the devices
      assert (per_gpu, r["accumulation"]) == (micro, 1)
    else:  # fixed global batch: fewer micro batches per GPU as devices grow
      assert r["global_batch"] == config.global_batch
      assert r["accumulation"] == config.global_batch // (r["devices"] * micro)


def _stored_sim(workdir, scheme, n, m, config):
  return load_jsonl(os.path.join(workdir, SIMULATIONS_FILE))[simulation_key(scheme, n, m, config, config.moe)]


def test_priced_bytes_are_the_small_runs_rows_times_each_ways_bytes(sweep):
  """node_limited on 2 x 2 with FP8 dispatch and bfloat16 combine (the wire dtypes only reprice the small run): the
  priced bytes and all-to-alls are the run's rows, scaled, times a row's bytes from the dtypes, counted here."""
  workdir, _, _ = sweep
  config = tiny_config()
  config.moe.update(dispatch_dtype="float8_e4m3fn", combine_dtype="bfloat16")
  sim = _stored_sim(workdir, "node_limited", 2, 2, config)  # the same small run as the sweep's bf16 one
  layer = price_point_layer(sim, Point("node_limited", 2, 2, "tiny", "weak"), config)
  d, k = config.models.tiny.d_model, config.moe.top_k  # 32, 2: a deduplicated row carries both choices
  out = d + 4 + k * (4 + 4)  # e4m3 payload, one float32 scale (d <= 128), an int32 id and a float32 weight per slot
  back = 2 * d  # the result in bfloat16
  grad_out, grad_back = 2 * d, 2 * d + k * 4  # gradients in bfloat16; the weights' float32 gradients come back
  assert (layer["dispatch_bytes_per_row"], layer["combine_bytes_per_row"]) == (out, back)
  scale = config.models.tiny.micro_batch * config.models.tiny.seq_len / sim["tokens_per_gpu"]
  rows = np.rint(np.asarray(sim["traffic_rows"], np.float64) * scale)  # [hops 'node', 'gpu', 4, 4]
  node = np.arange(4) // 2
  cross = node[:, None] != node[None, :]
  assert layer["inter_node_mb_per_gpu"] == pytest.approx(rows[:, cross].sum() * (out + back) / 4 / 1e6, rel=1e-12)
  assert layer["intra_node_mb_per_gpu"] == pytest.approx(
    (rows[:, ~cross].sum() - np.trace(rows, axis1=1, axis2=2).sum()) * (out + back) / 4 / 1e6, rel=1e-12
  )
  hops, topology = ("node", "gpu"), topology_lib.get(config.topology)

  def a2a(r, hop, bytes_per_row):
    return collectives.all_to_all(r * bytes_per_row, mesh_lib.same_group(hop, 2, 2), 2, topology).time_s

  forward = sum(a2a(r, h, out) + a2a(r.T, h, back) for r, h in zip(rows, hops))
  backward = sum(a2a(r, h, grad_out) + a2a(r.T, h, grad_back) for r, h in zip(rows, hops))
  got = layer["forward"].inter_node_a2a_s + layer["forward"].intra_node_a2a_s
  assert got == pytest.approx(forward, rel=1e-12)
  got = layer["train"].inter_node_a2a_s + layer["train"].intra_node_a2a_s
  assert got == pytest.approx(forward + backward, rel=1e-12)


def test_dedup_moves_node_limited_across_nodes_once_per_token(sweep):
  """Top-2 on one node of two: with dedup a token crosses to the other node once, carrying both choices; without,
  once per choice. The experts' work is the same. In the sweep (32 tokens per GPU: latency-bound exchanges) and
  repriced at 4096 tokens of d 512, where the bytes dominate."""
  workdir, rows, _ = sweep
  by = {(r["scheme"], r["nodes"], r["scaling"]): r for r in rows}
  big = tiny_config()
  big.models.tiny.update(d_model=512, micro_batch=32, seq_len=128)
  for base in ("node_limited", "smile"):
    dedup, nodedup = by[base, 2, "weak"], by[f"{base}_nodedup", 2, "weak"]
    assert (dedup["dedup"], nodedup["dedup"]) == (True, False)
    assert dedup["layer_inter_node_ms"] < nodedup["layer_inter_node_ms"]
    assert dedup["layer_expert_ms"] == nodedup["layer_expert_ms"]
    # a row of two slots against two rows of one: half the rows, each 8 bytes more
    ratio = dedup["inter_node_mb_per_gpu"] / nodedup["inter_node_mb_per_gpu"]
    wire = (dedup["dispatch_bytes_per_row"] + dedup["combine_bytes_per_row"]) / (
      nodedup["dispatch_bytes_per_row"] + nodedup["combine_bytes_per_row"]
    )
    assert ratio == pytest.approx(wire / 2, rel=0.05)
    once, twice = (
      price_point_layer(_stored_sim(workdir, scheme, 2, 2, big), Point(scheme, 2, 2, "tiny", "weak"), big)
      for scheme in (base, f"{base}_nodedup")
    )
    for part in ("forward", "train"):
      assert once[part].inter_node_a2a_s < 0.6 * twice[part].inter_node_a2a_s
      assert once[part].total_s < twice[part].total_s


def test_fp8_dispatch_prices_fewer_bytes_than_bf16_and_the_same_backward(sweep):
  workdir, _, _ = sweep
  point = Point("node_limited", 2, 2, "tiny", "weak")
  layers = {}
  for dtype in ("float8_e4m3fn", "bfloat16"):
    config = tiny_config()
    config.models.tiny.d_model = 512  # 4 scales of 4 bytes on 512 e4m3 elements
    config.moe.dispatch_dtype = dtype
    layers[dtype] = price_point_layer(_stored_sim(workdir, "node_limited", 2, 2, config), point, config)
  fp8, bf16 = layers["float8_e4m3fn"], layers["bfloat16"]
  assert (fp8["dispatch_bytes_per_row"], bf16["dispatch_bytes_per_row"]) == (512 + 16 + 16, 1024 + 16)
  assert fp8["combine_bytes_per_row"] == bf16["combine_bytes_per_row"] == 1024
  assert fp8["inter_node_mb_per_gpu"] < bf16["inter_node_mb_per_gpu"]
  assert fp8["forward"].inter_node_a2a_s < bf16["forward"].inter_node_a2a_s
  backward = {k: v["train"].inter_node_a2a_s - v["forward"].inter_node_a2a_s for k, v in layers.items()}
  assert backward["float8_e4m3fn"] == pytest.approx(backward["bfloat16"], rel=1e-12)  # gradients in bf16 both


def test_ragged_traffic_scales_linearly_with_modelled_tokens():
  config = tiny_config()
  rows = [[3, 1, 2, 2], [0, 4, 1, 3], [2, 0, 3, 3], [1, 1, 2, 4]]  # 8 tokens per device, flat top-1
  sim = {"traffic_rows": [rows], "rows_per_device": np.sum(rows, axis=0).tolist(), "dropped": 0, "tokens_per_gpu": 8}
  sim["control"] = {"collectives": [], "node_of": [0, 0, 1, 1]}  # a hand-made run: no control collectives
  point = Point("flat_dropless", 2, 2, "tiny", "weak")
  small = price_point_layer(sim, point, config)
  config.models.tiny.micro_batch *= 4
  large = price_point_layer(sim, point, config)
  assert small["token_scale"] * 4 == large["token_scale"]
  assert np.isclose(large["inter_node_mb_per_gpu"], 4 * small["inter_node_mb_per_gpu"])
  assert large["forward"].expert_compute_s == pytest.approx(4 * small["forward"].expert_compute_s, rel=1e-3)


def test_balanced_routers_route_uniformly():
  moe = tiny_config().moe
  flat = scheme_config("flat_dropless", 4, 16, moe, 16, 32)  # 64 experts, d 16
  bilevel = scheme_config("smile", 4, 2, moe, 16, 32)  # routers of 4 + 2 columns
  x = np.random.default_rng(1).standard_normal((1 << 16, 16))
  counts = np.bincount(np.argmax(x @ balanced_routers(flat, 0)["router"]["kernel"], axis=1), minlength=64)
  assert counts.max() / counts.mean() < 1.1  # the layer's own initialisation: about 3.7
  routers = balanced_routers(bilevel, 0)
  both = np.concatenate([routers["node_router"]["kernel"], routers["local_router"]["kernel"]], axis=1)
  np.testing.assert_allclose(both.T @ both, np.eye(6), atol=1e-12)  # i.i.d. logits, independent choices


@pytest.mark.parametrize(
  "field, value, named",
  [
    ("schemes", ("switch", "gshard"), "schemes"),
    ("gpus_per_node", (16,), "gpus_per_node"),
    ("global_batch", 24, "global_batch"),
    ("topology", "tpu_pod", "topology"),
    ("topology_overrides", "nic_bw", "topology_overrides"),
    ("moe.node_top_k", 3, "moe.node_top_k"),
    ("moe.smile_capacity_factor", -1.0, "moe.smile_capacity_factor"),
    ("models.tiny.micro_batch", 0, "models.tiny.micro_batch"),
    ("sim.tokens_per_gpu", 0, "sim.tokens_per_gpu"),
    ("models.tiny.moe_layers", 3, "models.tiny.moe_layers"),
    ("measure.platform", "tpu", "measure.platform"),
    ("gemm_sms", 0, "gemm_sms"),
  ],
)
def test_config_errors_name_their_field(field, value, named):
  config = tiny_config()
  *parents, leaf = field.split(".")
  target = config
  for parent in parents:
    target = target[parent]
  target[leaf] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == named
  assert named in str(error.value)


@pytest.mark.parametrize(
  "scheme, field, value",
  [
    ("comet", "moe.num_chunks", 3),  # does not divide sim.d_model = 16
    ("chunked", "moe.num_chunks", 0),
    ("s1", "moe.esp_capacity_factor", -1.0),
  ],
)
def test_schedule_scheme_errors_name_their_field(scheme, field, value):
  config = tiny_config()
  config.schemes = (scheme,)
  config.moe[field.split(".")[1]] = value
  with pytest.raises(ConfigError) as error:
    validate(config)
  assert error.value.field == field


@pytest.fixture(scope="module")
def schedule_sweep(tmp_path_factory, sweep):
  workdir = str(tmp_path_factory.mktemp("schedules"))
  shutil.copy(os.path.join(sweep[0], SIMULATIONS_FILE), workdir)  # the first sweep's small runs
  config = tiny_config()
  config.schemes = ("flat_dropless", "chunked", "comet", "esp_baseline", "s1", "s2")
  config.scalings = ("weak",)
  config.moe.num_chunks = 1  # only reprices: the small runs are reused
  rows, counts = run(config, workdir)
  return config, {(r["scheme"], r["nodes"]): r for r in rows}, counts


def test_overlap_schedules_reuse_the_flat_run_and_one_chunk_is_sequential(schedule_sweep):
  _, rows, counts = schedule_sweep
  assert counts["simulated"] == 0  # chunked and comet take flat_dropless's small runs; Parm's schemes need none
  for n in (1, 2):
    flat, chunked, comet = rows["flat_dropless", n], rows["chunked", n], rows["comet", n]
    assert chunked["layer_ms"] == pytest.approx(flat["layer_ms"], rel=1e-12)
    assert chunked["layer_hidden_ms"] == pytest.approx(0, abs=1e-12) and flat["layer_hidden_ms"] == 0
    assert 0 < comet["layer_hidden_ms"] and 0 < comet["comm_hidden_fraction"] <= 1
    assert comet["layer_ms"] == pytest.approx(
      sum(comet[f] for f in ("layer_inter_node_ms", "layer_intra_node_ms", "layer_expert_ms", "layer_other_ms"))
      + comet["layer_control_ms"]
      - comet["layer_hidden_ms"],
      rel=1e-12,
    )


def test_parm_schemes_compute_each_token_once_and_share_samples_over_the_mp_group(schedule_sweep):
  config, rows, _ = schedule_sweep
  micro = config.models.tiny.micro_batch
  for n in (1, 2):
    base = rows["esp_baseline", n]
    for scheme in ("s1", "s2"):  # PauseMP (Parm Sec. IV): the baseline computes every token N_MP = 2 times
      assert rows[scheme, n]["layer_expert_ms"] == pytest.approx(base["layer_expert_ms"] / 2, rel=1e-12)
    assert {rows[s, n]["esp_choice"] for s in ("esp_baseline", "s1", "s2")} <= {"s1", "s2"}
    assert base["global_batch"] == n * micro  # one MP group of 2 GPUs per node shares its samples
    assert (base["layer_inter_node_ms"] == 0) == (n == 1)


@pytest.fixture(scope="module")
def measured_sweep(tmp_path_factory, devices):
  """SMILE on a 2x2 mesh under strong scaling, also timed on the (simulated) CPU devices."""
  config = tiny_config()
  config.nodes, config.schemes, config.scalings = (2,), ("smile",), ("strong",)
  config.models.tiny.micro_batch = 2  # strong scaling: 16 samples = 2 micro batches of 2 on 4 devices
  config.measure.update(platform="cpu", warmup=1, repeats=2, max_repeats=3, layer_max_repeats=4)
  workdir = str(tmp_path_factory.mktemp("measured"))
  rows, counts = run(config, workdir)
  return config, workdir, rows, counts


def test_cpu_measured_points_time_the_layer_and_a_real_training_step(measured_sweep):
  config, _, rows, counts = measured_sweep
  assert counts == {"computed": 2, "skipped": 0, "simulated": 1}
  modelled = {(r["scheme"], r["scaling"]): r for r in rows if r["label"] == "modelled"}
  measured = {(r["scheme"], r["scaling"]): r for r in rows if r["label"] == "measured"}
  assert measured.keys() == modelled.keys() == {("smile", "strong")}
  model = config.models.tiny
  for key, r in measured.items():
    want = modelled[key]
    assert (r["global_batch"], r["accumulation"], r["tokens_per_gpu"]) == (
      want["global_batch"],
      want["accumulation"],
      want["tokens_per_gpu"],
    )
    assert r["accumulation"] == 2
    # Nothing is stable before the sixth call (moejax.study.repeats): each program runs to its own cap.
    assert r["device"] == "cpu" and (r["repeats"], r["layer_repeats"]) == (3, 4)
    assert 0 < r["step_s_min"] <= r["step_s"] and r["layer_ms"] >= r["layer_ms_min"] > 0
    phases = [r[f"layer_{part}_ms"] for part in ("inter_node", "intra_node", "expert", "other")]
    assert sum(phases) == pytest.approx(r["layer_ms"]) and min(phases[:3]) > 0  # SMILE: both hops
    assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["step_s"])
    # The timed step is the MLM objective: at initialisation (embeddings of std 0.02, near-uniform
    # logits) its loss is about ln(vocab) plus the small load-balancing term.
    assert abs(r["loss_first"] - np.log(model.vocab)) < 0.3, r["loss_first"]
    assert np.isfinite(r["loss_last"])
    assert (r["routing"], r["path"], r["collective"]) == (want["routing"], want["path"], want["collective"])
    # measure.price_program: the timed layer and step programs priced with terms timed on the 2 x 2 mesh
    assert r["priced_layer_ms"] > 0 and r["priced_step_s"] > r["priced_layer_ms"] / 1e3
    assert r["priced_layer_error"] == pytest.approx(r["priced_layer_ms"] / r["layer_ms"] - 1)
    split = (r["priced_layer_collectives_ms"], r["priced_layer_compute_ms"])
    assert min(split) > 0 and sum(split) == pytest.approx(r["priced_layer_ms"])
    assert r["priced_step_error"] == pytest.approx(r["priced_step_s"] / r["step_s"] - 1)


def test_measured_rows_are_reported_resumed_and_written(measured_sweep, tmp_path):
  config, workdir, rows, _ = measured_sweep
  again, counts = run(config, workdir)
  assert counts == {"computed": 0, "skipped": 2, "simulated": 0} and again == rows
  table = report.comparison_table(rows)
  assert "measured strong" in table.splitlines()[1] and "on cpu" in table.splitlines()[0]
  smile = next(r for r in rows if (r["label"], r["scheme"], r["scaling"]) == ("measured", "smile", "strong"))
  line = next(line for line in table.splitlines() if " smile " in line)
  measured, error, priced = line.split()[-3:]  # the measured samples/s, the model's error and the priced program's
  assert float(measured) == pytest.approx(smile["samples_per_s"], rel=1e-4)  # fixed-point, 5+ digits
  modelled = next(r for r in rows if (r["label"], r["scheme"], r["scaling"]) == ("modelled", "smile", "strong"))
  assert error == f"{modelled['step_s'] / smile['step_s'] - 1:+.0%}"
  assert priced == f"{smile['priced_step_s'] / smile['step_s'] - 1:+.0%}"
  paths = report.write_all(rows, config, str(tmp_path))
  assert "measured.png" in paths and all(os.path.getsize(path) > 0 for path in paths.values())
  with open(paths["results.csv"]) as f:
    written = [r for r in csv.DictReader(f) if r["label"] == "measured"]
  assert len(written) == 1 and all(float(r["step_s"]) > 0 and r["device"] == "cpu" for r in written)


def test_the_layers_control_collectives_are_priced_from_its_compiled_program(sweep):
  """A small run records its compiled layer's collectives that carry no rows (node_limited on 2 x 2: each hop's plan
  all-gathers its send sizes, the statistics' all-reduce over all 4 devices); the modelled layer pays them once per
  pass, on the point's topology, as NCCL's ring over their groups (written out here in float64)."""
  from moejax.cost import program_price
  from moejax.study import points as points_lib

  workdir, _, _ = sweep
  config = tiny_config()
  sim = _stored_sim(workdir, "node_limited", 2, 2, config)
  found = sim["control"]["collectives"]
  assert {c["kind"] for c in found} == {"all-gather", "all-reduce"} and all(c["count"] == 1 for c in found)
  topo = points_lib.topology(config)
  want = 0.0
  node_of = sim["control"]["node_of"]
  assert sorted(node_of) == [0, 0, 1, 1]
  for c in found:  # every group of these spans whole mesh axes: one ring per group
    nodes, size = len({node_of[i] for i in c["groups"][0]}), len(c["groups"][0])
    rounds = 2 if c["kind"] == "all-reduce" else 1
    inter = rounds * (nodes - 1)
    concurrent = len(c["groups"]) if nodes > 1 else 1
    bw = topo["intra_bw"] if nodes == 1 else min(topo["intra_bw"], topo["nic_bw"] / concurrent)
    latency = (rounds * (size - 1) - inter) * topo["intra_latency"] + inter * topo["inter_latency"]
    want += topo["launch"] + latency + rounds * (size - 1) / size * c["bytes"] / bw
  assert program_price.control_seconds(sim["control"], topo) == pytest.approx(want, rel=1e-12) and want > 0
  layer = price_point_layer(sim, Point("node_limited", 2, 2, "tiny", "weak"), config)
  for phase in ("forward", "train"):
    b = layer[phase]
    assert b.control_s == pytest.approx(want)
    assert b.total_s == pytest.approx(b.inter_node_a2a_s + b.intra_node_a2a_s + b.expert_compute_s + b.other_s + want)
