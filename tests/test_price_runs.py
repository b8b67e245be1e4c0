"""Runs of a measured sweep against the programs' prices (`moejax.study.price_runs`, experiments/price_runs.py): the
summary equals NumPy's median, extremes and count on random errors; the bound is met only when every point and the
median are within it; the tables hold each run's values in order; bad workdirs are refused by name."""

import json
import subprocess
import sys

import numpy as np
import pytest

from moejax.study import price_runs
from moejax.validation import ConfigError
from tests.helpers import ENV

SCHEMES = ("switch", "smile", "flat_dropless")


def _rows(rng, errors=None) -> list[dict]:
  rows = []
  for i, (scheme, nodes) in enumerate((s, n) for n in (1, 2) for s in SCHEMES):
    layer, step = rng.uniform(10, 200), rng.uniform(0.1, 1.0)
    layer_error, step_error = rng.uniform(-0.5, 0.5, 2) if errors is None else (errors[i], errors[i])
    rows.append(
      dict(label="measured", model="cpu", scaling="weak", scheme=scheme, nodes=nodes, gpus_per_node=4,
           layer_ms=layer, priced_layer_ms=layer * (1 + layer_error), priced_layer_error=layer_error,
           step_s=step, priced_step_s=step * (1 + step_error), priced_step_error=step_error,
           **dict(zip(("layer_inter_node_ms", "layer_intra_node_ms", "layer_expert_ms", "layer_other_ms",
                       "priced_layer_collectives_ms", "priced_layer_compute_ms"), rng.uniform(1, 100, 6))))
    )  # fmt: skip
  return rows


def test_the_summary_is_numpys_on_random_errors():
  rng = np.random.default_rng()
  rows = _rows(rng)
  errors = np.asarray([r["priced_layer_error"] for r in rows])
  s = price_runs.summary(rows, "priced_layer_error", each=0.3, median=0.2)
  assert s["median_abs"] == pytest.approx(np.median(np.abs(errors)), rel=1e-12)
  assert (s["low"], s["high"]) == (errors.min(), errors.max())
  assert s["within"] == int(np.sum(np.abs(errors) <= 0.3)) and s["points"] == len(rows)
  assert s["met"] == bool(np.all(np.abs(errors) <= 0.3) and np.median(np.abs(errors)) <= 0.2)


def test_the_bound_needs_every_point_and_the_median():
  rng = np.random.default_rng()
  inside = rng.uniform(-0.08, 0.08, 6)
  assert price_runs.summary(_rows(rng, inside), "priced_step_error")["met"]
  one_out = inside.copy()
  one_out[rng.integers(6)] = rng.choice([-1, 1]) * rng.uniform(0.26, 0.5)  # one point beyond 25%
  assert not price_runs.summary(_rows(rng, one_out), "priced_step_error")["met"]
  wide = rng.choice([-1, 1], 6) * rng.uniform(0.11, 0.24, 6)  # every point within 25%, the median beyond 10%
  assert not price_runs.summary(_rows(rng, wide), "priced_layer_error")["met"]


def test_the_tables_hold_each_runs_values_in_order():
  rng = np.random.default_rng()
  beyond = rng.choice([-1, 1], 6) * rng.uniform(0.26, 0.5, 6)  # run a misses its bound surely, b meets it
  runs = {"a": _rows(rng, beyond), "b": _rows(rng, rng.uniform(-0.08, 0.08, 6))}
  runs["b"] = runs["b"][1:]  # a point run b lacks: '-' there
  table = price_runs.points_table(runs).splitlines()
  assert len(table) == 2 + 6
  first = runs["a"][0]
  assert table[2].startswith("| cpu | weak | switch | 1x4 | ") and f"{first['layer_ms']:.0f} / - |" in table[2]
  line = next(t for t in table if "| smile | 2x4 |" in t)
  a, b = (next(r for r in runs[n] if (r["scheme"], r["nodes"]) == ("smile", 2)) for n in "ab")
  assert f"{a['priced_step_error']:+.0%} / {b['priced_step_error']:+.0%}" in line
  summary = price_runs.summary_table(runs)
  assert "| b | " in summary and summary.endswith("(2 of 4 run-quantities)") and "not met" in summary
  record = price_runs.record(runs)
  assert record["runs"]["b"]["layer"]["points"] == 5 and len(record["runs"]["a"]["step"]["rows"]) == 6


def test_the_split_table_sums_the_profiles_phases_beside_the_price():
  """Collectives: the profile's inter- and intra-node phases summed; compute: its expert and other phases; each beside
  its price; a row without a profile shows '-'."""
  rng = np.random.default_rng()
  rows = _rows(rng)
  rows[1]["layer_expert_ms"] = float("nan")
  table = price_runs.split_table({"only": rows}).splitlines()
  first = rows[0]
  collectives = first["layer_inter_node_ms"] + first["layer_intra_node_ms"]
  compute = first["layer_expert_ms"] + first["layer_other_ms"]
  want = [f"{v:.0f}" for v in (collectives, first["priced_layer_collectives_ms"], compute,
                               first["priced_layer_compute_ms"])]  # fmt: skip
  assert table[2] == "| cpu | weak | switch | 1x4 | " + " | ".join(want) + " |"
  assert table[3].endswith(f"| {rows[1]['priced_layer_collectives_ms']:.0f} | - | - |")


def test_workdirs_without_priced_points_are_refused(tmp_path):
  with pytest.raises(ConfigError, match="results.json"):
    price_runs.load(str(tmp_path))
  rows = _rows(np.random.default_rng())
  for r in rows:
    r.pop("priced_layer_error")
  (tmp_path / "results.json").write_text(json.dumps({"config": {}, "rows": rows}))
  with pytest.raises(ConfigError, match="price_program"):
    price_runs.load(str(tmp_path))


@pytest.mark.slow
def test_command_prints_both_tables_and_writes_the_json(tmp_path):
  """experiments.price_runs over two sweep workdirs: the points' and the runs' tables, the verdict and
  price_runs.json holding each run's summary; a workdir without priced points is refused by name in one line."""
  rng = np.random.default_rng()
  sweeps = []
  for name in ("first", "second"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps({"config": {}, "rows": _rows(rng)}))
    sweeps.append(str(tmp_path / name))
  out = tmp_path / "out"
  command = [sys.executable, "-m", "experiments.price_runs", f"--workdir={out}"]
  done = subprocess.run(
    command + [f"--config.sweeps={','.join(sweeps)}"], env=ENV, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "| cpu | weak | smile | 2x4 |" in done.stdout and "| second | " in done.stdout
  assert "the bound (every point within 25%, the median within 10%, in every run)" in done.stdout
  assert "the layer's split, profiled against priced" in done.stdout
  record = json.loads((out / "price_runs.json").read_text())
  assert set(record["runs"]) == {"first", "second"} and record["runs"]["first"]["layer"]["points"] == 6
  done = subprocess.run(
    command + [f"--config.sweeps={sweeps[0]},{tmp_path}"], env=ENV, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
    f"error: config field sweep workdir='{tmp_path}' is not allowed: a workdir with results.json (run the sweep first)"
  ]
