"""experiments.wire_traffic: with dedup every hop moves exactly the rows its routing needs (counted apart in NumPy),
without it one row per choice; the byte accounting per wire; the summary against DeepEP; docs/wire.md's tables are
the committed record's."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import wire_traffic as wt
from moejax.moe import path as path_lib
from moejax.study import wire_bounds
from tests.helpers import ENV, ROOT

RECORD = ROOT / "benchmarks" / "results" / "2026-11-25-cpu" / "wire_traffic.json"
pytestmark = pytest.mark.xdist_group("wire_traffic")  # one worker runs the quick study its tests share


@pytest.fixture(scope="module")
def wire_traffic_run(tmp_path_factory):
  """(record, stdout) of `python -m experiments.wire_traffic --config.quick=True`."""
  workdir = tmp_path_factory.mktemp("wire")
  run = subprocess.run(
    [sys.executable, "-m", "experiments.wire_traffic", "--config.quick=True", f"--workdir={workdir}"],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads((workdir / "wire_traffic.json").read_text()), run.stdout


def runs(record, dedup=None):
  for case in record["cases"]:
    for run in case["runs"]:
      if dedup is None or run["dedup"] == dedup:
        yield case, run


# Hand-made routing on 2 nodes x 2 GPUs, 12 experts (3 per device), one token per device: token 0 (device 0) has
# experts 3, 4 (device 1) and 9 (device 3, the other node); every other token's experts are on its own device.
IDS = np.array([[3, 4, 9], [3, 4, 5], [6, 7, 8], [9, 10, 11]])
SELF = {(1, 1): 1, (2, 2): 1, (3, 3): 1}  # the other tokens' rows to their own device (a slot each without dedup)
SELF3 = {k: 3 for k in SELF}


def matrix(entries: dict) -> np.ndarray:
  out = np.zeros((4, 4), np.int64)
  for (s, p), rows in entries.items():
    out[s, p] = rows
  return out


@pytest.mark.parametrize(
  "path,dedup,expected",
  [
    ("flat", True, [{(0, 1): 1, (0, 3): 1, **SELF}]),
    ("flat", False, [{(0, 1): 2, (0, 3): 1, **SELF3}]),
    # node hop: devices 1 and 3 seen from device 0 are node 0 (itself) and node 1 at GPU 0 (device 2)
    ("node_first", True, [{(0, 0): 1, (0, 2): 1, **SELF}, {(0, 1): 1, (2, 3): 1, **SELF}]),
    ("node_first", False, [{(0, 0): 2, (0, 2): 1, **SELF3}, {(0, 1): 2, (2, 3): 1, **SELF3}]),
    # gpu hop: all three at GPU 1 (device 1), then node hop: node 0 (device 1 itself) and node 1 (device 3)
    ("gpu_first", True, [{(0, 1): 1, **SELF}, {(1, 1): 2, (1, 3): 1, (2, 2): 1, (3, 3): 1}]),
    ("gpu_first", False, [{(0, 1): 3, **SELF3}, {(1, 1): 5, (1, 3): 1, (2, 2): 3, (3, 3): 3}]),
  ],
)
def test_bound_rows_by_hand(path, dedup, expected):
  got = wire_bounds.bound_rows(IDS, 12, 4, 2, path_lib.hops(path), dedup=dedup)
  assert got.shape == (len(expected), 4, 4)
  for hop, entries in zip(got, expected):
    np.testing.assert_array_equal(hop, matrix(entries))


def test_deepep_rows_by_hand():
  assert wire_bounds.deepep_rows(IDS, 12, 4, 2) == 1  # token 0 to node 1 once; the rest stay on their node
  # 3 nodes x 1 GPU: token 0 reaches the two other nodes, token 1 one, token 2 none
  assert wire_bounds.deepep_rows(np.array([[0, 4, 8], [1, 2, 3], [8, 9, 10]]), 12, 3, 1) == 3


@pytest.mark.slow  # the quick run simulates 16 meshes and routings (about 16 s)
def test_quick_covers_meshes_routings_and_paths(wire_traffic_run):
  record, _ = wire_traffic_run
  seen = {(tuple(c["mesh"]), c["routing"], r["path"], r["dedup"]) for c, r in runs(record)}
  want = {
    (mesh, routing, path, dedup)
    for mesh in ((2, 4), (4, 2))
    for routing in ("topk", "node_limited")
    for path in ("flat", "node_first")
    for dedup in (False, True)
  }
  assert want <= seen


@pytest.mark.slow
def test_dedup_moves_exactly_the_bound(wire_traffic_run):
  record, _ = wire_traffic_run
  for case, run in runs(record, dedup=True):
    for hop in run["hops"]:
      where = (case["preset"], case["mesh"], run["path"], hop["hop"])
      assert hop["equals_bound"] and hop["rows"] == hop["bound_rows"] > 0, where
      assert f"{hop['ratio']:.2f}" == "1.00", where


@pytest.mark.slow
def test_without_dedup_one_row_per_choice_and_more(wire_traffic_run):
  record, _ = wire_traffic_run
  for case, run in runs(record, dedup=False):
    hops = run["hops"]
    assert all(hop["equals_per_choice"] for hop in hops), (case["preset"], case["mesh"], run["path"])
    # with top-8 over 8 devices tokens have several experts on one device (and node): more rows than the bound
    assert all(hop["rows"] > hop["bound_rows"] for hop in hops), (case["preset"], case["mesh"], run["path"])
    on = next(r for r in case["runs"] if r["path"] == run["path"] and r["dedup"])
    assert sum(h["rows"] for h in hops) > sum(h["rows"] for h in on["hops"])


@pytest.mark.slow
def test_bytes_per_row_and_per_token(wire_traffic_run):
  record, _ = wire_traffic_run
  for case, run in runs(record):
    d, slots, rb = case["published_d"], run["slots_per_row"], run["row_bytes"]
    total = {w: b["out"] + b["back"] for w, b in rb.items()}
    assert total["fp8"] < total["bf16"] < total["fp32"]
    assert rb["fp8"]["out"] < rb["bf16"]["out"] < rb["fp32"]["out"]
    assert rb["fp8"]["out"] == d + 4 * -(-d // 128) + 8 * slots and rb["fp32"]["out"] == 4 * d + 8 * slots
    assert rb["fp8"]["back"] == rb["bf16"]["back"] == 2 * d and rb["fp32"]["back"] == 4 * d
    for hop in run["hops"]:
      for w, b in rb.items():
        got = hop["bytes_per_token"][w]
        assert got["inter"] == pytest.approx(hop["inter_rows_per_token"] * total[w])
        assert got["intra"] == pytest.approx(hop["intra_rows_per_token"] * total[w])


@pytest.mark.slow
def test_summary_against_deepep(wire_traffic_run):
  record, stdout = wire_traffic_run
  assert len(record["summary"]) == len(record["cases"])
  for s in record["summary"]:
    assert s["after_rows"] == s["deepep_rows"] > 0  # once per other node, as DeepEP
    assert s["after_payload"] == pytest.approx(s["deepep_payload"])
    assert s["after"] <= s["deepep_message"] and s["at_or_below_deepep"], s
    assert s["after"] < s["node_first_before"] / 4
  assert "inter rows/tok" in stdout and "at/below" in stdout and stdout.count(" yes") == len(record["summary"])


def test_docs_tables_are_the_committed_record():
  record = json.loads(RECORD.read_text())
  assert not record["quick"] and {c["preset"] for c in record["cases"]} == set(wt.MESHES)
  doc = (ROOT / "docs" / "wire.md").read_text()
  assert wt.markdown_summary(record) in doc
  assert wt.markdown_hops(record) in doc
  layer = pathlib.Path(ROOT / "docs" / "layer.md").read_text()
  assert "(wire.md)" in layer
