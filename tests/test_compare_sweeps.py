"""experiments/compare_sweeps.py on two tiny synthetic sweep workdirs (one results.json, one results.csv only)."""

import json
import subprocess
import sys

import pytest

from experiments import compare_sweeps
from moejax.study import plots, report, sweep_plots
from tests.helpers import ENV


def _row(model, scheme, nodes, samples, label="modelled", topology="dgx_h100_ib", device=""):
  return dict(
    label=label,
    model=model,
    scaling="weak",
    nodes=nodes,
    gpus_per_node=8,
    scheme=scheme,
    samples_per_s=samples,
    layer_ms=1000.0 / samples,
    topology=topology,
    device=device,
  )


def _workdirs(tmp_path):
  a, b = tmp_path / "h100", tmp_path / "p4d"
  a.mkdir()
  b.mkdir()
  rows_a = [_row("tiny", s, n, v) for s, f in (("switch", 100.0), ("smile", 150.0)) for n, v in ((1, f), (4, 3 * f))]
  (a / "results.json").write_text(json.dumps({"config": {"topology": "dgx_h100_ib"}, "rows": rows_a}))
  rows_b = [_row("small", "smile", n, 10.0 * n, topology="p4d_efa") for n in (1, 2, 4, 8)]
  rows_b.append(_row("small", "smile", 1, 7.0, label="measured", device="cpu"))
  report.write_csv(rows_b, str(b / "results.csv"))
  return a, b


def test_curves_are_split_by_config_and_labelled(tmp_path):
  a, b = _workdirs(tmp_path)
  found = compare_sweeps.curves([str(a), str(b)])
  assert len(found) == 4  # h100: switch, smile; p4d: modelled smile, measured smile
  by_label = {c["label"]: c for c in found}
  assert len(by_label) == 4
  h100_smile = next(c for c in found if c["name"] == "h100" and c["scheme"] == "smile")
  assert h100_smile["points"] == [(1, 150.0), (4, 450.0)]
  assert "dgx_h100_ib" in h100_smile["label"] and "modelled" in h100_smile["label"]
  measured = next(c for c in found if c["kind"] == "measured")
  assert measured["points"] == [(1, 7.0)] and "measured on cpu" in measured["label"]
  modelled_csv = next(c for c in found if c["name"] == "p4d" and c["kind"] == "modelled")
  assert modelled_csv["points"] == [(1, 10.0), (2, 20.0), (4, 40.0), (8, 80.0)]  # read back from the CSV as numbers

  table = compare_sweeps.format_table(found, "samples_per_s").splitlines()
  assert table[0] == "training throughput (samples/s) against nodes"
  assert table[1].split()[1:] == ["1", "2", "4", "8"]
  line = next(x for x in table if x.startswith(h100_smile["label"]))
  assert line[len(h100_smile["label"]) :].split() == ["150.000", "-", "450.000", "-"]  # column 1 holds 7.0
  assert len({len(x) for x in table[1:]}) == 1  # right-aligned columns of one width


def test_selection_by_scheme_scaling_and_model(tmp_path):
  a, b = _workdirs(tmp_path)
  assert {c["scheme"] for c in compare_sweeps.curves([str(a), str(b)], schemes=["switch"])} == {"switch"}
  assert compare_sweeps.curves([str(a), str(b)], scalings=["strong"]) == []
  assert {c["model"] for c in compare_sweeps.curves([str(a), str(b)], models=["small"])} == {"small"}
  assert compare_sweeps.available([str(a), str(b)])["scheme"] == ["smile", "switch"]


def _many_workdirs(tmp_path, count=2):
  """`count` workdirs of 5 schemes x 2 scalings whose dropless schemes coincide: 10 curves each."""
  dirs = []
  for i in range(count):
    d = tmp_path / f"run{i}"
    d.mkdir()
    rows = [
      dict(_row("small", s, n, (1.3 if s != "switch" else 1.0) * 100.0 * n * (i + 1)), scaling=sc)
      for s in ("switch", "flat_dropless", "hierarchical", "smile", "node_limited")
      for n in (1, 2, 4)
      for sc in ("weak", "strong")
    ]
    (d / "results.json").write_text(json.dumps({"config": {}, "rows": rows}))
    dirs.append(str(d))
  return dirs


def _assert_distinct_curves(ax):
  from matplotlib.colors import to_hex

  looks = [
    (to_hex(line.get_color()), line.get_marker(), line.get_linestyle(), str(line.get_markerfacecolor()))
    for line in ax.get_lines()
  ]
  assert len(set(looks)) == len(looks), "two curves are drawn alike"


def test_figure_draws_many_curves_apart_with_readable_labels(tmp_path):
  found = compare_sweeps.curves(_many_workdirs(tmp_path))
  assert len(found) == 20
  fig = compare_sweeps.figure(found, "samples_per_s")
  (ax,) = fig.axes
  assert len(ax.get_lines()) == 20
  _assert_distinct_curves(ax)
  assert ax.get_ylabel() == "training throughput (samples/s)"
  assert list(ax.get_xticks()) == [1, 2, 4] and [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
  labels = [t.get_text() for t in fig.legends[0].texts]
  assert len(set(labels)) == 20 and not any("GPUs/node" in label for label in labels)  # shared: in the title
  assert "8 GPUs/node" in ax.get_title() and "small" in ax.get_title()
  styles = compare_sweeps.curve_styles(found)
  for c, style in zip(found, styles):  # a scheme keeps its colour and marker of the sweep's plots
    assert (style["color"], style["marker"]) == plots.SCHEME_STYLES[c["scheme"]][:2]
  (tmp_path / "five").mkdir()
  more = compare_sweeps.curves(_many_workdirs(tmp_path / "five", count=5))  # more variants than linestyles x fills
  assert len({tuple(s.values()) for s in compare_sweeps.curve_styles(more)}) == len(more) == 50
  assert compare_sweeps.figure(found, "layer_ms").axes[0].get_ylabel() == "MoE layer forward (ms)"


def test_the_style_check_catches_curves_drawn_alike(tmp_path, monkeypatch):
  found = compare_sweeps.curves(_many_workdirs(tmp_path, count=1))
  same = dict(color="tab:blue", marker="o", linestyle="-", markerfacecolor="tab:blue")
  monkeypatch.setattr(compare_sweeps, "curve_styles", lambda curves: [same] * len(curves))
  (ax,) = compare_sweeps.figure(found, "samples_per_s").axes
  with pytest.raises(AssertionError, match="alike"):
    _assert_distinct_curves(ax)


@pytest.mark.slow
def test_command_prints_the_table_and_writes_one_png(tmp_path):
  a, b = _workdirs(tmp_path)
  out = tmp_path / "out"
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.compare_sweeps",
      f"--config.sweeps={a},{b}",
      "--config.labels=H100 run,P4d run",
      f"--workdir={out}",
    ],
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "H100 run: tiny switch x8 GPUs/node, weak, modelled on dgx_h100_ib" in done.stdout
  assert "P4d run: small smile x8 GPUs/node, weak, measured on cpu" in done.stdout
  assert (out / "compare_sweeps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.compare_sweeps",
      f"--config.sweeps={a},{b}",
      "--config.schemes=switch",
      f"--workdir={out}",
    ],
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0 and "smile" not in done.stdout and "switch" in done.stdout, done.stderr[-2000:]
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.compare_sweeps",
      f"--config.sweeps={a},{b}",
      "--config.scalings=strong",
      f"--workdir={out}",
    ],
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode != 0 and "scalings: weak" in done.stderr
  done = subprocess.run(
    [sys.executable, "-m", "experiments.compare_sweeps", f"--config.sweeps={a},{tmp_path}", f"--workdir={out}"],
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 1 and done.stderr.strip().splitlines() == [
    f"error: config field sweeps='{tmp_path}' is not allowed: sweep workdirs with results.json or results.csv (run "
    "the sweep first)"
  ]


def test_paper_points_only_where_the_sweep_is_the_papers_setting(tmp_path):
  from configs import scaling_smile

  config = scaling_smile.get_config()
  points = plots.paper_points(config, "smile_3_7b", "weak", "p4d_efa")
  assert {(p["scheme"], p["samples_per_s"]) for p in points} == {("switch", 8112.0), ("smile", 20011.0)}
  assert {p["samples_per_s"] for p in plots.paper_points(config, "smile_48b", "strong", "p4d_efa+nic_bw=2e10")} == {
    889.0,
    2223.0,
  }
  assert plots.paper_points(config, "smile_48b", "weak", "p4d_efa") == []  # micro batch 64: weak is not Table 2
  assert plots.paper_points(config, "smile_3_7b", "weak", "dgx_h100_ib") == []
  config.global_batch = 4096
  assert plots.paper_points(config, "smile_13b", "strong", "p4d_efa") == []
  config.global_batch = 16384
  rows = [
    dict(_row("smile_3_7b", s, n, 1000.0 * n, topology="p4d_efa"), scaling=sc)
    for s in ("switch", "smile")
    for n in (1, 16)
    for sc in ("weak", "strong")
  ]
  sweep_plots.plot_throughput(rows, str(tmp_path / "t.png"), config)
  assert (tmp_path / "t.png").stat().st_size > 0
