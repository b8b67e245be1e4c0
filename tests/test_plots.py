"""The scaling sweep's plots and table (moejax.study.report) on synthetic rows: every scheme drawn in its own style,
node counts on the axis, titles that name the model, topology and 'modelled', y axes from zero, the scaling efficiency
against ideal scaling, strong scaling's accumulated micro batches said where they show, fixed-width table columns
and no column that is zero everywhere."""

import re

import numpy as np
import pytest

from configs import scaling_default
from moejax.study import efficiency, measured_plots, plots, report, sweep_plots
from moejax.study.points import SCHEMES

DEFAULT_SCHEMES = ("switch", "flat_dropless", "hierarchical", "smile", "node_limited")
NODES = (1, 2, 4)


def _rows(schemes=DEFAULT_SCHEMES, nodes=NODES, gpus=(4,), measured=False, big=False):
  """Modelled rows of a sweep on p4d_efa where three schemes coincide (as README's main job's do); with
  `measured`, one measured row per scheme on 1 node; with `big`, throughputs cross 1e5 mid-column."""
  rows = []
  for m in gpus:
    for s, scheme in enumerate(schemes):
      for n in nodes:
        for scaling in ("weak", "strong"):
          speed = 20000.0 * n * (1.0 if scheme == "switch" else 1.3 + 0.001 * s) * (7.0 if big and n == 4 else 1.0)
          rows.append(
            dict(
              label="modelled",
              model="small",
              scaling=scaling,
              nodes=n,
              gpus_per_node=m,
              scheme=scheme,
              samples_per_s=speed,
              topology="p4d_efa",
              device="",
              layer_inter_node_ms=0.1 * (n - 1),
              layer_intra_node_ms=0.06,
              layer_expert_ms=0.12,
              layer_other_ms=0.024,
              layer_hidden_ms=0.0,
              layer_ms=0.2 + 0.1 * (n - 1),
              step_s=512 / speed,
            )
          )
      if measured:
        rows += [
          dict(
            rows[-1],
            label="measured",
            nodes=1,
            scaling=sc,
            samples_per_s=3.21 + s,
            device="cpu",
            layer_ms=12.5,
            step_s=512 / (3.21 + s),
          )
          for sc in ("weak", "strong")
        ]
  return rows


def _accumulating(rows):
  """`rows` as a sweep writes them: strong scaling's global batch of one micro batch per GPU at 4 nodes accumulates
  4 and 2 micro batches a step at 1 and 2 nodes."""
  return [dict(r, accumulation=4 // r["nodes"] if r["scaling"] == "strong" else 1) for r in rows]


def _scheme_lines(ax):
  """{legend label: (colour, marker, linestyle)} of the panel's lines that have a label."""
  from matplotlib.colors import to_hex

  return {
    line.get_label(): (to_hex(line.get_color()), line.get_marker(), line.get_linestyle())
    for line in ax.get_lines()
    if not line.get_label().startswith("_")
  }


def _visible_axes(fig):
  return [ax for ax in fig.axes if ax.get_visible()]


def _titles(fig):
  return " ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes])


def _assert_distinct_schemes(ax, schemes):
  lines = _scheme_lines(ax)
  assert set(schemes) <= set(lines), (schemes, list(lines))
  pairs = [lines[s][:2] for s in schemes]
  assert len(set(pairs)) == len(pairs), f"two schemes share a (colour, marker): {dict(zip(schemes, pairs))}"


def test_every_scheme_has_its_own_colour_and_marker_everywhere():
  assert set(SCHEMES) <= set(plots.SCHEME_STYLES)
  pairs = [style[:2] for style in plots.SCHEME_STYLES.values()]
  assert len(set(pairs)) == len(pairs)
  styles = plots.scheme_styles(["switch", "mystery", "other"])
  assert styles["switch"] == plots.SCHEME_STYLES["switch"]
  assert len({s[:2] for s in styles.values()}) == 3  # schemes it does not know get pairs nobody else has


def test_throughput_figure_tells_every_scheme_apart():
  config = scaling_default.get_config()
  fig = sweep_plots.throughput_figure(_rows(), config)
  axes = _visible_axes(fig)
  assert len(axes) == 2  # weak, strong
  for ax in axes:
    _assert_distinct_schemes(ax, DEFAULT_SCHEMES)
    assert list(ax.get_xticks()) == list(NODES)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    assert len(ax.get_xticks(minor=True)) == 0  # no 2^k minor ticks
    labels = [t.get_text() for t in ax.get_legend().texts]
    assert labels == list(DEFAULT_SCHEMES)  # the shared GPUs/node is in the title, not in every entry
    # Coinciding schemes: their markers are moved apart along x, and each point stays near its node count.
    xs = {line.get_label(): line.get_xdata() for line in ax.get_lines()}
    assert len({tuple(x) for x in xs.values()}) == len(DEFAULT_SCHEMES)
    for x in xs.values():
      assert all(0.9 < got / want < 1.1 for got, want in zip(x, NODES))
  title = _titles(fig)
  for word in ("small", "d_model 512", "p4d_efa", "modelled", "4 GPUs/node"):
    assert word in title, (word, title)
  assert "measured" not in title


def test_throughput_axes_start_at_zero_and_strong_scaling_says_it_accumulates():
  """From zero: a 5% gap between schemes no longer fills the panel. Strong scaling beats weak on one node only by
  accumulating micro batches (one gradient sync a step): the panel says how many."""
  fig = sweep_plots.throughput_figure(_accumulating(_rows()), scaling_default.get_config())
  weak, strong = _visible_axes(fig)
  assert weak.get_ylim()[0] == 0 == strong.get_ylim()[0]
  assert strong.get_title().endswith("\n4, 2, 1 micro batches a step at 1, 2, 4 nodes"), strong.get_title()
  assert weak.get_title().endswith("\n1 micro batch a step"), weak.get_title()


def test_efficiency_is_per_gpu_throughput_over_the_fewest_nodes():
  rows = _rows(nodes=(1, 2, 4))
  for r in rows:  # switch scales linearly; the others lose a quarter per doubling
    r["samples_per_s"] = (
      1000.0 * r["nodes"] * (1.0 if r["scheme"] == "switch" else 0.75 ** (r["nodes"].bit_length() - 1))
    )
  curves = efficiency.efficiency(rows)
  assert curves[("small", "weak", 4, "switch")] == [(1, 1.0), (2, 1.0), (4, 1.0)]
  assert curves[("small", "strong", 4, "smile")] == [(1, 1.0), (2, 0.75), (4, 0.5625)]
  fig = efficiency.efficiency_figure(_accumulating(rows), scaling_default.get_config())
  for ax in _visible_axes(fig):
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1.0
    ideal = [line for line in ax.get_lines() if line.get_label().startswith("ideal")]
    assert len(ideal) == 1 and list(ideal[0].get_ydata()) == [1.0, 1.0]
    _assert_distinct_schemes(ax, DEFAULT_SCHEMES)
    np.testing.assert_allclose(_scheme_line(ax, "smile").get_ydata(), [1.0, 0.75, 0.5625])
  assert "micro batches a step" in _titles(fig) and "p4d_efa" in _titles(fig)


def _scheme_line(ax, scheme):
  return next(line for line in ax.get_lines() if line.get_label() == scheme)


def test_a_shared_style_is_caught(monkeypatch):
  """The check above fails when two schemes are drawn alike."""
  monkeypatch.setitem(plots.SCHEME_STYLES, "smile", plots.SCHEME_STYLES["hierarchical"])
  ax = _visible_axes(sweep_plots.throughput_figure(_rows()))[0]
  with pytest.raises(AssertionError, match="share"):
    _assert_distinct_schemes(ax, DEFAULT_SCHEMES)


def test_throughput_figure_with_two_widths_and_measured_points():
  fig = sweep_plots.throughput_figure(_rows(gpus=(4, 8), measured=True), scaling_default.get_config())
  axes = _visible_axes(fig)
  assert len(axes) == 4  # (weak, strong) x (4, 8 GPUs/node): a panel each
  assert all(re.search(r"\d GPUs/node", ax.get_title()) for ax in axes)
  for ax in axes:
    _assert_distinct_schemes(ax, DEFAULT_SCHEMES)
    labels = [t.get_text() for t in ax.get_legend().texts]
    assert not any("GPUs/node" in label for label in labels)
    assert "switch, measured on cpu" in labels
  assert "measured on cpu" in _titles(fig) and "modelled" in _titles(fig)


def test_breakdown_figure_says_modelled_and_topology():
  fig = sweep_plots.breakdown_figure(_rows(), scaling_default.get_config())
  title = _titles(fig)
  for word in ("modelled", "cost model", "p4d_efa", "small", "d_model 512"):
    assert word in title, (word, title)
  (ax,) = _visible_axes(fig)
  assert "modelled" in ax.get_ylabel()
  assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["1x4 switch", "1x4 flat_dropless"]


@pytest.mark.slow
def test_plots_write_pngs(tmp_path):
  rows = _rows(measured=True)
  sweep_plots.plot_throughput(rows, str(tmp_path / "t.png"))
  sweep_plots.plot_breakdown(rows, str(tmp_path / "b.png"))
  efficiency.plot_efficiency(rows, str(tmp_path / "e.png"))
  for name in ("t.png", "b.png", "e.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _assert_fixed_columns(table: str) -> None:
  """Every numeric cell below the header ends where a column of the fullest line ends (right-aligned in columns of
  one width), and the cells of a column share one count of decimals (no exponent notation)."""
  columns = {}
  for line in table.splitlines()[2:]:
    for match in re.finditer(r"(?<=\s)-?\d[\d.e+-]*x?(?=\s|$)", line):
      cell = match.group().rstrip("x")
      assert "e" not in cell, (cell, line)
      columns.setdefault(match.end(), set()).add(len(cell.partition(".")[2]))
  fullest = max((line for line in table.splitlines()[2:]), key=lambda line: len(line.split()))
  edges = {m.end() for m in re.finditer(r"\d[\d.]*x?(?=\s|$)", fullest)}
  assert set(columns) <= edges, f"cells end off the columns {sorted(edges)}: {sorted(set(columns) - edges)}"
  for end, formats in columns.items():
    assert len(formats) == 1, f"column ending at {end} mixes decimals {formats}"


@pytest.mark.parametrize("measured", [False, True])
def test_table_columns_have_one_format_and_width(measured):
  table = report.comparison_table(_rows(big=True, measured=measured))
  lines = table.splitlines()[2:]
  assert len(lines) == len(DEFAULT_SCHEMES) * len(NODES)
  _assert_fixed_columns(table)
  big = next(line for line in lines if line.split()[1] == "4x4")
  assert re.search(r"\s\d{6}\s", big)  # 1.4e5 samples/s written out, not 1.4e+05


def test_the_table_shows_hidden_time_only_where_a_schedule_hides_some():
  header = report.comparison_table(_rows()).splitlines()[1].split()
  assert "hidden" not in header and "layer" in header  # no scheme overlaps: 0.000 in every line
  rows = [dict(r, layer_hidden_ms=0.05) if r["scheme"] == "smile" else r for r in _rows()]
  assert "hidden" in report.comparison_table(rows).splitlines()[1].split()


def test_the_table_says_how_many_micro_batches_strong_scaling_accumulates():
  assert not any(line.startswith("strong scaling") for line in report.comparison_table(_rows()).splitlines())
  last = report.comparison_table(_accumulating(_rows())).splitlines()[-1]
  assert last == (
    "strong scaling of small on 4 GPUs/node: 4, 2, 1 micro batches a step at 1, 2, 4 nodes (one "
    "gradient sync a step); weak scaling: 1, so strong is faster where it accumulates"
  )


@pytest.mark.parametrize(
  "table", ["h\nh\nx  1.000\ny  2.500\nz  3.5", "h\nh\nx  1.000\ny  2.500\nz   3.50", "h\nh\nx  1.000\ny  1.1e+05"]
)
def test_table_check_catches_a_mixed_column(table):
  """The format check above fails on a column that changes width, decimals or notation."""
  with pytest.raises(AssertionError):
    _assert_fixed_columns(table)


def test_fixed_column():
  assert report.fixed_column([17972.4, 106930.2, None]) == [" 17972", "106930", "      "]
  assert report.fixed_column([3.21, 40000.0]) == ["    3.210", "40000.000"]
  assert report.fixed_column([1.0, 1.25], decimals=2) == ["1.00", "1.25"]


def _calibrated_rows():
  """A calibrated two-host sweep's rows: modelled on 1 and 2 nodes, extrapolated on 4 (beyond the timed meshes), and
  measured on 1 and 2 nodes, where the layer took twice the model's time and the step half of it."""
  rows = [dict(r, label="extrapolated") if r["nodes"] == 4 else r for r in _rows(schemes=("switch", "smile"))]
  measured = [
    dict(
      r,
      label="measured",
      device="cpu",
      layer_ms=2 * r["layer_ms"],
      step_s=r["step_s"] / 2,
      samples_per_s=2 * r["samples_per_s"],
    )
    for r in rows
    if r["nodes"] < 4
  ]
  return rows + measured


def test_measured_rows_get_the_model_error_of_their_point():
  rows = report.with_model_error(_calibrated_rows())
  measured = [r for r in rows if r["label"] == "measured"]
  assert len(measured) == 2 * 2 * 2  # schemes x nodes x scalings
  for r in measured:
    assert r["layer_error"] == pytest.approx(-0.5) and r["step_error"] == pytest.approx(1.0)
    assert r["modelled_layer_ms"] == pytest.approx(r["layer_ms"] / 2)
  assert not any("layer_error" in r for r in rows if r["label"] != "measured")


def test_measured_figure_draws_measured_beside_modelled_with_the_error_and_marks_extrapolated():
  fig = measured_plots.measured_figure(report.with_model_error(_calibrated_rows()), scaling_default.get_config())
  axes = _visible_axes(fig)
  assert len(axes) == 3  # the layer, the step of each scaling
  for ax, error in zip(axes, ("-50%", "+100%", "+100%")):
    assert sorted(t.get_text() for t in ax.texts) == [error] * 4  # 2 schemes x 2 measured node counts
    labels = {line.get_label(): line for line in ax.get_lines()}
    for scheme in ("switch", "smile"):
      assert list(labels[f"{scheme}, measured"].get_xdata()) == [1, 2]
      assert list(labels[f"{scheme}, modelled"].get_xdata()) == [1, 2]
      assert list(labels[f"{scheme}, extrapolated"].get_xdata()) == [4]
    assert any(line.get_linestyle() == ":" for line in ax.get_lines())  # the extrapolated stretch dotted
  assert "extrapolated" in _titles(fig) and "measured on cpu" in _titles(fig)


def test_measured_figure_draws_each_points_spread_down_to_its_fastest_repeat():
  rng = np.random.default_rng(7)
  rows = []
  for r in report.with_model_error(_calibrated_rows()):
    if r["label"] == "measured":
      r = dict(r, layer_ms_min=r["layer_ms"] * rng.uniform(0.5, 0.99), step_s_min=r["step_s"] * rng.uniform(0.5, 0.99))
    rows.append(r)
  axes = _visible_axes(measured_plots.measured_figure(rows, scaling_default.get_config()))
  for ax, (field, fastest, scaling) in zip(
    axes, (("layer_ms", "layer_ms_min", None), ("step_s", "step_s_min", "weak"), ("step_s", "step_s_min", "strong"))
  ):
    mine = [r for r in rows if r["label"] == "measured" and scaling in (None, r["scaling"])]
    if scaling is None:
      mine = [r for r in mine if r["scaling"] == mine[0]["scaling"]]
    drawn = sorted(
      (float(x0), float(min(y0, y1)), float(max(y0, y1)))
      for collection in ax.collections
      for (x0, y0), (_, y1) in collection.get_segments()
    )
    assert drawn == pytest.approx(sorted((r["nodes"], r[fastest], r[field]) for r in mine))


def test_the_table_marks_extrapolated_meshes():
  table = report.comparison_table(_calibrated_rows())
  meshes = [line.split()[1] for line in table.splitlines()[2:] if line.startswith("small")]
  assert sorted(set(meshes)) == ["1x4", "2x4", "4x4*"]
  assert table.splitlines()[-1].startswith("* extrapolated")
  _assert_fixed_columns(table)


def test_throughput_rings_the_extrapolated_points():
  rows = [r for r in _calibrated_rows() if r["label"] != "measured"]
  for ax in _visible_axes(sweep_plots.throughput_figure(rows, scaling_default.get_config())):
    rings = [line for line in ax.get_lines() if line.get_marker() == "o" and line.get_markersize() == 17]
    assert [line.get_label() for line in ax.get_legend().get_lines()].count(
      "extrapolated beyond the calibrated meshes"
    ) == 1
    assert sorted(round(x) for line in rings for x in line.get_xdata()) == [4, 4]  # each scheme's 4-node point
  assert not any(
    line.get_markersize() == 17
    for ax in _visible_axes(sweep_plots.throughput_figure(_rows()))
    for line in ax.get_lines()
  )


def test_measured_figure_draws_each_schemes_own_program_price():
  rng = np.random.default_rng(11)
  rows = [
    dict(r, priced_layer_ms=r["layer_ms"] * rng.uniform(0.5, 1.5), priced_step_s=r["step_s"] * rng.uniform(0.5, 1.5))
    if r["label"] == "measured"
    else r
    for r in report.with_model_error(_calibrated_rows())
  ]
  layer = _visible_axes(measured_plots.measured_figure(rows, scaling_default.get_config()))[0]
  crosses = {line.get_label(): line for line in layer.get_lines() if line.get_label().endswith("program priced")}
  assert sorted(crosses) == ["smile, program priced", "switch, program priced"]
  for scheme in ("switch", "smile"):
    mine = [r for r in rows if r["label"] == "measured" and r["scheme"] == scheme and r["scaling"] == "weak"]
    drawn = sorted(
      zip(crosses[f"{scheme}, program priced"].get_xdata(), crosses[f"{scheme}, program priced"].get_ydata())
    )
    assert drawn == pytest.approx(sorted((r["nodes"], r["priced_layer_ms"]) for r in mine))
