"""The routers' convergence study (experiments/convergence.py): its router configs, its metrics and its quick mode."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import convergence as study_config
from experiments import convergence, convergence_report
from moejax.train import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", ["default", "quick"])
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_router_configs_are_valid_with_equal_active_widths(mode, model, tmp_path):
  study = study_config.get_config(mode)
  (tmp_path / "train.jsonl").write_text('{"text": "a document"}\n')
  for router in study_config.ROUTERS:
    config = convergence.train_config(study, model, router, 0, str(tmp_path / "train.jsonl"), str(tmp_path))
    model_cfg, moe_cfg = config_lib.validate(config)
    assert moe_cfg.capacity_factor is None
    active = model_cfg.d_ff * (moe_cfg.top_k * moe_cfg.node_top_k if moe_cfg.routing == "bilevel" else moe_cfg.top_k)
    active += moe_cfg.num_shared_experts * (moe_cfg.shared_d_ff or model_cfg.d_ff)
    assert active == study.d_ff, router
    assert moe_cfg.num_experts * model_cfg.d_ff == study.num_experts * study.d_ff, router


def test_load_curves_busiest_and_drop_share():
  records = [{"expert_load": [[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]]}]
  curves = convergence.load_curves(records, capacity=1.25)
  assert curves["busiest_load"] == [pytest.approx((2.0 + 1.0) / 2)]
  # layer 0: 0.5 - 1.25 / 4 = 0.1875 above capacity; layer 1: nothing
  assert curves["drop_share"] == [pytest.approx(0.1875 / 2)]


def test_table_rows_mean_and_spread_over_seeds():
  results = [{"model": "gpt", "router": "switch", "heldout_loss": h, "train_loss": [9.0, t],
              "busiest_load": [1.5], "drop_share": [0.1]} for h, t in ((2.0, 1.0), (4.0, 3.0))]
  (row,) = convergence_report.table_rows(results, tail=1)
  assert row["heldout_loss"] == 3.0 and row["heldout_spread"] == pytest.approx(np.std([2.0, 4.0], ddof=1))
  assert row["train_loss"] == 2.0 and row["seeds"] == 2
  assert "| gpt | switch | 2 | 3.0000 ± 1.4142 |" in convergence_report.format_table([row], 1.25)


# The study's two routing mechanisms beyond flat softmax top-k (SMILE bi-level; DeepSeek-V3's sigmoid, bias and
# shared expert); test_train trains flat top-k, bi-level and node-limited routing, and every router's config is
# validated above.
QUICK_ROUTERS = ("smile", "deepseek_v3")


@pytest.mark.slow
def test_quick_mode_writes_results_and_resumes(devices, shared, tmp_path, capsys):
  study = study_config.get_config("quick")
  study.routers = ",".join(QUICK_ROUTERS)
  cache = str(shared / "cache")  # the session's corpus
  rows = convergence.run_study(study, str(tmp_path), ["gpt"], cache)
  for name in ("results.json", "table.md", "loss.png", "busiest_load.png"):
    assert os.path.getsize(tmp_path / name) > 0, name
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["table"] == rows and [row["router"] for row in rows] == list(QUICK_ROUTERS)
  for row in rows:
    assert math.isfinite(row["heldout_loss"]) and math.isfinite(row["train_loss"]) and row["busiest_load"] >= 1.0
    assert 0.0 <= row["drop_share"] < 1.0
  for run in results["runs"]:
    assert len(run["train_loss"]) == len(run["busiest_load"]) == len(run["steps"]) == 8
  table = (tmp_path / "table.md").read_text().splitlines()
  assert len(table) == 2 + len(QUICK_ROUTERS)
  # Run again: every run is re-used, nothing is trained, the same table.
  capsys.readouterr()
  assert convergence.run_study(study, str(tmp_path), ["gpt"], cache) == rows
  assert capsys.readouterr().out.count("(re-used)") == len(QUICK_ROUTERS)


def test_command_line_names_an_unknown_router(tmp_path):
  command = [sys.executable, "-m", "experiments.convergence", f"--workdir={tmp_path}",
             f"--config={ROOT}/configs/convergence.py:quick", "--config.routers=switch,expert_choice"]
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0 and "routers ['expert_choice']" in done.stderr, done.stderr[-3000:]
  assert not os.listdir(tmp_path)  # refused before anything is written
