"""The routers' convergence study (experiments/convergence.py): its router configs, its metrics and its quick mode."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import convergence as study_config
from experiments import convergence
from moejax.study import convergence as convergence_report
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
  results = [
    {
      "model": "gpt",
      "router": "switch",
      "heldout_loss": h,
      "train_loss": [9.0, t],
      "busiest_load": [1.5],
      "drop_share": [0.1],
    }
    for h, t in ((2.0, 1.0), (4.0, 3.0))
  ]
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
  study.routers = QUICK_ROUTERS
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
  command = [
    sys.executable,
    "-m",
    "experiments.convergence",
    f"--workdir={tmp_path}",
    f"--config={ROOT}/configs/convergence.py:quick",
    "--config.routers=switch,expert_choice",
  ]
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0 and "routers ['expert_choice']" in done.stderr, done.stderr[-3000:]
  assert not os.listdir(tmp_path)  # refused before anything is written


def _synthetic_results(routers=("switch", "gshard", "smile"), models=("gpt", "bert"), seeds=(0, 1), steps=40):
  """Runs whose loss curves almost coincide (as the study's do): router i's loss is switch's + 0.001 i."""
  rng = np.random.default_rng(0)
  return [
    {
      "model": m,
      "router": r,
      "seed": s,
      "steps": list(range(1, steps + 1)),
      "train_loss": list(5.0 - np.linspace(0, 1, steps) + 0.001 * i + 0.01 * rng.standard_normal(steps)),
      "busiest_load": list(2.0 + 0.5 * i + 0.1 * rng.standard_normal(steps)),
      "drop_share": [0.1] * steps,
      "heldout_loss": 4.0 + 0.001 * i,
    }
    for m in models
    for i, r in enumerate(routers)
    for s in seeds
  ]


def _labelled_lines(ax):
  from matplotlib.colors import to_hex

  return {
    line.get_label(): (to_hex(line.get_color()), line.get_marker())
    for line in ax.get_lines()
    if not line.get_label().startswith("_")
  }


def _assert_routers_apart(ax, routers):
  lines = _labelled_lines(ax)
  pairs = [next(v for k, v in lines.items() if k.split(" ")[0] == r) for r in routers]
  assert len(set(pairs)) == len(pairs), f"routers share a (colour, marker): {dict(zip(routers, pairs))}"


def test_loss_figure_draws_curves_and_differences_from_the_baseline():
  routers = ("switch", "gshard", "smile")
  fig = convergence_report.loss_figure(_synthetic_results(routers), mesh=[2, 4])
  assert len(fig.axes) == 4  # (curves, differences) x (gpt, bert)
  top, bottom = fig.axes[0], fig.axes[2]  # gpt's column
  _assert_routers_apart(top, routers)
  assert "gpt" in top.get_title() and "minus switch" in bottom.get_title()
  diffs = {k: line for k in routers[1:] for line in bottom.get_lines() if line.get_label() == k}
  assert set(diffs) == {"gshard", "smile"}  # the baseline is the zero line and its seeds' band
  assert abs(np.mean(diffs["smile"].get_ydata()) - 0.002) < 0.02  # 0.001 x rank 2 above switch, within the noise
  assert "2 x 4 CPU mesh" in fig._suptitle.get_text() and "measured" in fig._suptitle.get_text()


def test_load_figure_has_a_panel_per_model_and_router():
  routers = ("switch", "gshard", "smile")
  fig = convergence_report.load_figure(_synthetic_results(routers))
  titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
  assert titles == [f"{m}-MoE, {r}" for m in ("gpt", "bert") for r in routers]
  colours = [_labelled_lines(ax)[r][0] for ax, r in zip(fig.axes, routers)]
  assert len(set(colours)) == len(routers)
  assert "switch" in _labelled_lines(fig.axes[1])  # the baseline drawn beside every other router


def test_the_router_style_check_catches_a_shared_style(monkeypatch):
  monkeypatch.setitem(convergence_report.ROUTER_STYLES, "gshard", convergence_report.ROUTER_STYLES["switch"])
  fig = convergence_report.loss_figure(_synthetic_results())
  with pytest.raises(AssertionError, match="share"):
    _assert_routers_apart(fig.axes[0], ("switch", "gshard", "smile"))


def test_router_styles_cover_the_study_and_unknown_routers():
  styles = convergence_report.router_styles([*study_config.ROUTERS, "expert_choice"])
  assert len({s[:2] for s in styles.values()}) == len(study_config.ROUTERS) + 1


def test_redraw_from_a_results_json(tmp_path):
  results = _synthetic_results()
  record = {"config": {"steps": 40, "capacity": 1.25}, "mesh": [2, 4], "runs": results}
  (tmp_path / "results.json").write_text(json.dumps(record))
  paths = convergence_report.redraw(str(tmp_path / "results.json"), str(tmp_path / "out"))
  assert [os.path.basename(p) for p in paths] == ["table.md", "loss.png", "busiest_load.png"]
  assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert len((tmp_path / "out" / "table.md").read_text().splitlines()) == 2 + 6


def test_the_report_command_redraws_a_workdirs_results(tmp_path):
  (tmp_path / "results.json").write_text(
    json.dumps({"config": {"steps": 40, "capacity": 1.25}, "mesh": [2, 4], "runs": _synthetic_results()})
  )
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  command = [sys.executable, "-m", "experiments.convergence_report", f"--workdir={tmp_path}"]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "table.md").exists()
  done = subprocess.run(
    [*command[:-1], f"--workdir={tmp_path / 'empty'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
    f"error: config field results='{tmp_path / 'empty' / 'results.json'}' is not allowed: a convergence study's "
    "results.json ('' = the one in --workdir)"
  ]


def test_the_committed_plots_data_gives_the_committed_table():
  """docs/convergence/ is drawn from the committed JSON (`redraw`): its table matches the committed table.md."""
  path = os.path.join(ROOT, "benchmarks/results/2026-11-23-cpu/convergence.json")
  with open(path) as f:
    record = json.load(f)
  rows = convergence_report.table_rows(record["runs"], tail=record["config"]["steps"] // 10)
  with open(os.path.join(ROOT, "docs/convergence/table.md")) as f:
    assert convergence_report.format_table(rows, record["config"]["capacity"]) + "\n" == f.read()
