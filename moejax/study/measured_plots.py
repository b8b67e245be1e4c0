"""The scaling sweep's measured.png (`moejax.study.report` writes it): the measured points beside the modelled ones
of the same points, with the model's error at each, the repeats' spread and the timed program's own price, in the
style of `moejax.study.plots`."""

import textwrap

from moejax.study.plots import _grid, _save, _scheme_order, _where, model_text, node_axis, scheme_styles

MEASURED_PANELS = (("layer_ms", "layer_error", "MoE layer forward (ms)"), ("step_s", "step_error", "training step (s)"))
# Each measured value's fastest repeat: the spread drawn below its median.
FASTEST = {"layer_ms": "layer_ms_min", "step_s": "step_s_min"}
# The timed program's own price, where the sweep priced it (measure.price_program).
PRICED = {"layer_ms": "priced_layer_ms", "step_s": "priced_step_s"}


def _value_axis(ax, values) -> None:
  """y from zero, or logarithmic where the values span more than 20x (an uncalibrated model against a CPU)."""
  positive = [v for v in values if v > 0]
  if positive and max(positive) / min(positive) > 20:
    ax.set_yscale("log")
  else:
    ax.set_ylim(bottom=0, top=1.15 * max(positive, default=1.0))


def _measured_curves(ax, mine: list[dict], styles: dict, field: str, error: str) -> list[float]:
  """One panel's curves per measured scheme: modelled points hollow on a line, extrapolated ones on a dotted line,
  measured points filled and labelled with the model's error there, the timed program's price (where priced) as a
  cross; returns every value drawn (for the y axis)."""
  values = []
  for scheme in sorted({r["scheme"] for r in mine if r["label"] == "measured"}, key=_scheme_order):
    colour, marker, _ = styles[scheme]
    points = {
      label: sorted((r["nodes"], r[field], r.get(error)) for r in mine if r["scheme"] == scheme and r["label"] == label)
      for label in ("modelled", "extrapolated", "measured")
    }
    line = points["modelled"] + points["extrapolated"]
    if points["modelled"]:
      ax.plot(
        *zip(*[p[:2] for p in points["modelled"]]),
        color=colour,
        marker=marker,
        markerfacecolor="none",
        linestyle="-",
        label=f"{scheme}, modelled",
      )
    if points["extrapolated"]:
      tail = points["modelled"][-1:] + points["extrapolated"]
      ax.plot(*zip(*[p[:2] for p in tail]), color=colour, linestyle=":")
      ax.plot(
        *zip(*[p[:2] for p in points["extrapolated"]]),
        color=colour,
        marker=marker,
        markerfacecolor="none",
        linestyle="none",
        alpha=0.6,
        label=f"{scheme}, extrapolated",
      )
    nodes, timed, errors = zip(*points["measured"])
    ax.plot(nodes, timed, color=colour, marker=marker, linestyle="none", markersize=9, label=f"{scheme}, measured")
    timed_rows = [r for r in mine if r["scheme"] == scheme and r["label"] == "measured"]
    spread = [(r["nodes"], r[FASTEST[field]], r[field]) for r in timed_rows if FASTEST[field] in r]
    if spread:  # the repeats' spread: a bar from the fastest repeat up to the median
      ax.vlines(*zip(*spread), color=colour, linewidth=2, alpha=0.5)
    for n, t, e in points["measured"]:
      if e is not None:
        ax.annotate(f"{e:+.0%}", (n, t), textcoords="offset points", xytext=(6, 4), fontsize=8, color=colour)
    priced = sorted((r["nodes"], r[PRICED[field]]) for r in timed_rows if PRICED[field] in r)
    if priced:
      ax.plot(
        *zip(*priced), color=colour, marker="x", linestyle="none", markersize=8, label=f"{scheme}, program priced"
      )
    values += [p[1] for p in line] + list(timed) + [p[1] for p in priced] + [p[1] for p in spread]
  return values


def measured_figure(rows: list[dict], config=None):
  """The measured rows beside their modelled points: per (model, GPUs per node), one panel of the layer forward and
  one of the training step per scaling, against nodes. Per scheme in its SCHEME_STYLES colour: modelled points
  hollow on a line, extrapolated ones (beyond a calibration's timed meshes) hollow on a dotted line, measured points
  filled, each labelled with the model's error there (modelled / measured - 1: `report.with_model_error`'s
  layer_error and step_error), with a bar down to its fastest repeat, and the timed program's price as a cross where
  the sweep priced it. Returns the matplotlib Figure."""
  measured = [r for r in rows if r["label"] == "measured"]
  groups = sorted({(r["model"], r["gpus_per_node"]) for r in measured})
  scalings = list(dict.fromkeys(r["scaling"] for r in measured))
  styles = scheme_styles(sorted({r["scheme"] for r in rows}, key=_scheme_order))
  panels = [
    (g, field, error, name, scaling)
    for g in groups
    for field, error, name in MEASURED_PANELS
    for scaling in ((None,) if field == "layer_ms" else scalings)
  ]
  fig, axes = _grid(len(panels))
  for ax, ((model, m), field, error, name, scaling) in zip(axes, panels):
    mine = [
      r for r in rows if (r["model"], r["gpus_per_node"]) == (model, m) and (scaling is None or r["scaling"] == scaling)
    ]
    if scaling is None:  # the layer does not depend on the scaling: one scaling's rows
      mine = [r for r in mine if r["scaling"] == mine[0]["scaling"]]
    values = _measured_curves(ax, mine, styles, field, error)
    node_axis(ax, [r["nodes"] for r in mine])
    _value_axis(ax, values)
    ax.set_ylabel(name)
    title = f"{model}, {m} GPUs/node" + (f", {scaling} scaling" if scaling else "")
    ax.set_title(title + "\nlabels: the model's error at each measured point", fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the panel: the points fill it
  topology, where = _where(rows)
  head = (
    f"Measured points beside the model ({topology}{where}); hollow: modelled, dotted: extrapolated beyond the "
    "calibrated meshes, filled: measured"
  )
  fig.suptitle(
    textwrap.fill(head, max(80, 60 * len(panels[:3]))) + "\n" + "; ".join(model_text(config, g[0]) for g in groups),
    fontsize=10,
  )
  return fig


def plot_measured(rows: list[dict], path: str, config=None) -> None:
  """`measured_figure` written as a PNG."""
  _save(measured_figure(rows, config), path)
