"""The paper validation (moejax/study/papers, run by experiments/validate_cost_model.py): the driver from
another working directory, Lina's Fig. 7 timeline and comparison rows."""

import json
import shutil
import subprocess
import sys

import pytest

from moejax.cost import contention
from moejax.study.papers import comet, lina
from tests.helpers import ENV


def validate(cwd, *options):
  return subprocess.run(
    [sys.executable, "-m", "experiments.validate_cost_model", "--workdir=.", *options],
    cwd=cwd,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
def test_the_driver_runs_from_any_directory(tmp_path):
  """The repository's benchmark JSON is found from the repository and named relative to it; --workdir and a given
  config.comet_rate_json are taken from the working directory as usual."""
  done = validate(tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "validate_cost_model.json").read_text())
  assert list(record) == ["smile", "comet", "parm", "lina"]
  source = record["comet"]["setting"]["h800_rate"][1]
  assert source.startswith("measured: benchmarks/results/2026-11-23-h100/kernels-mixtral_8x7b.json "), source
  assert all(f"===== {name} =====" in done.stdout for name in record)

  shutil.copy(comet.RATE_JSON, tmp_path / "mine.json")
  done = validate(tmp_path, "--config.sections=comet", "--config.comet_rate_json=mine.json")
  assert done.returncode == 0, done.stderr[-3000:]
  source = json.loads((tmp_path / "validate_cost_model.json").read_text())["comet"]["setting"]["h800_rate"][1]
  assert source.startswith("measured: mine.json "), source


def test_fig7_timeline():
  """Lina Fig. 7 ticks (ms): overlapped (a) the first A2A ends at 17.7 and the gradients at 29.0; deferred or
  prioritized (c, d) the gradients end at 24.6 and the deferred all-reduce at 30.4."""
  runs = {s: contention.backward(lina.fig7_layer(), s) for s in contention.SYNC_ORDERS}
  assert runs["naive_overlap"].compute_end_s * 1e3 == pytest.approx(29.0, rel=0.02)
  assert (5.7 + runs["naive_overlap"].a2a_s[-2] * 1e3) == pytest.approx(17.7, rel=0.02)
  assert runs["prioritized"].compute_end_s * 1e3 == pytest.approx(24.6, rel=1e-9)
  assert runs["default"].end_s * 1e3 == pytest.approx(30.4, rel=1e-9)


def test_validation_rows():
  rows = lina.validation_rows()
  table = lina.format_table(rows)
  for r in rows:
    assert r["quantity"] in table
    assert r["paper"] is None or any(tag in r["source"] for tag in ("Fig.", "Sec.", "Abstract"))
    assert r["modelled"] > 0
  fit = [r for r in rows if r["role"].startswith("fit")]
  assert len(fit) == 2 and all(r["modelled"] == pytest.approx(r["paper"], rel=1e-9) for r in fit)  # Fig. 7c's two
  for r in rows:  # no schedule beats a link to itself: every speedup modelled is at least 1
    if "speedup" in r["quantity"]:
      assert r["modelled"] >= 1 - 1e-12


def test_the_smile_sweep_can_take_the_fitted_inter_node_terms():
  """configs/scaling_smile.py's FITTED_OVERRIDES are the validation's fit, so the sweep prices with the same model."""
  from configs import scaling_smile
  from moejax.cost import topology as topology_lib
  from moejax.study.papers import smile

  fitted = smile.fit_inter_node(topology_lib.P4D_EFA)[0]
  overrides = topology_lib.parse_overrides(scaling_smile.FITTED_OVERRIDES)
  assert overrides.keys() == {"inter_latency", "nic_bw"}
  for field, value in overrides.items():
    assert value == pytest.approx(fitted[field], rel=1e-9), field
