"""Overlays the scaling curves of several sweep workdirs (moejax.study.sweep) in one plot and one table.

  python -m experiments.compare_sweeps --config.sweeps=/tmp/sweep_h100,/tmp/sweep_p4d --workdir=/tmp/compare
  python -m experiments.compare_sweeps --config.sweeps=a,b --config.labels="DGX H100,P4d EFA" \
      --config.metric=layer_ms --workdir=/tmp/compare
  python -m experiments.compare_sweeps --config.sweeps=a,b --config.schemes=switch,smile --config.scalings=weak \
      --workdir=/tmp/weak

configs/compare_sweeps.py holds the options. Each sweep workdir's results.json ({"config", "rows"}, written by `moejax.study.report.write_all`) is read, or its
results.csv when there is no JSON. A curve is one (workdir, model, scaling, scheme, GPUs per node, modelled or
measured) over nodes, labelled by its config: the workdir's label (config.labels, default its directory name), the
topology, model, scheme, mesh width, scaling and whether it is modelled or measured, so that runs on two
topologies, two models, or modelled against measured read apart; config.schemes, scalings and models keep only
those rows. Prints one line per curve (the metric at every node count any curve has, one fixed-point format per
column) and writes compare_sweeps.png to --workdir: x nodes (log 2, a tick per node count), y the metric (log) labelled with its unit.
A scheme keeps its colour and marker of the sweep's plots (plots.SCHEME_STYLES); the linestyle and a filled or
hollow marker tell its curves from different workdirs, models, scalings, widths or kinds apart, and no two curves
are drawn alike. The legend names what differs between curves; what they all share is in the title.
"""

import csv
import json
import os
import sys

from moejax import cli, workdir_guard
from moejax.study import plots, report
from moejax.validation import require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "compare_sweeps.py")

CURVE_KEY = ("model", "scaling", "scheme", "gpus_per_node", "label")
NUMERIC = ("nodes", "gpus_per_node", "samples_per_s", "layer_ms", "step_s")


def load_rows(workdir: str) -> tuple[list[dict], dict]:
  """(rows, config) of a sweep workdir: results.json, else results.csv (config {} then)."""
  path = os.path.join(workdir, "results.json")
  if os.path.exists(path):
    with open(path) as f:
      record = json.load(f)
    return record["rows"], record.get("config", {})
  path = os.path.join(workdir, "results.csv")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} has neither results.json nor results.csv (run the sweep first)")
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for field in NUMERIC:
      if row.get(field) not in (None, ""):
        row[field] = float(row[field]) if field not in ("nodes", "gpus_per_node") else int(float(row[field]))
  return rows, {}


def curves(
  workdirs, labels=None, metric: str = "samples_per_s", schemes=None, scalings=None, models=None
) -> list[dict]:
  """One dict per curve: label, workdir, its config fields and points [(nodes, metric)] sorted by nodes. schemes,
  scalings, models: keep only rows with these values (None: all)."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f"{len(labels)} labels for {len(workdirs)} workdirs")
  wanted = {"scheme": schemes, "scaling": scalings, "model": models}
  out = []
  for workdir, name in zip(workdirs, labels):
    rows, _ = load_rows(workdir)
    groups = {}
    for row in rows:
      if row.get(metric) in (None, "") or any(keep and row.get(f) not in keep for f, keep in wanted.items()):
        continue
      groups.setdefault(tuple(row[k] for k in CURVE_KEY), []).append(row)
    for key, members in groups.items():
      fields = dict(zip(CURVE_KEY, key))
      topology = members[0].get("topology") or ""
      where = f"on {members[0].get('device')}" if fields["label"] == "measured" else f"on {topology}"
      out.append(
        dict(
          fields,
          kind=fields["label"],
          workdir=workdir,
          name=name,
          topology=topology,
          where=where,
          label=f"{name}: {fields['model']} {fields['scheme']} x{fields['gpus_per_node']} GPUs/node, "
          f"{fields['scaling']}, {fields['label']} {where}",
          points=sorted((int(r["nodes"]), float(r[metric])) for r in members),
        )
      )
  return out


def available(workdirs) -> dict[str, list]:
  """The schemes, scalings and models the workdirs' rows have, to name in an error when a selection is empty."""
  rows = [row for workdir in workdirs for row in load_rows(workdir)[0]]
  return {field: sorted({str(r.get(field)) for r in rows}) for field in ("scheme", "scaling", "model")}


def format_table(found: list[dict], metric: str) -> str:
  """One line per curve, a column per node count; each column's numbers in one fixed-point format
  (report.fixed_column), '-' where a curve has no point."""
  nodes = sorted({n for c in found for n, _ in c["points"]})
  columns = [("curve", [c["label"] for c in found], "<")]
  for n in nodes:
    cells = report.fixed_column([dict(c["points"]).get(n) for c in found])
    columns.append((str(n), [cell if cell.strip() else "-".rjust(len(cell)) for cell in cells], ">"))
  return "\n".join([f"{plots.field_label(metric)} against nodes", *report.text_table(columns)])


# What tells curves apart besides the scheme (which fixes colour and marker, plots.SCHEME_STYLES).
VARIANT_KEY = ("name", "model", "scaling", "gpus_per_node", "kind", "where")


def curve_styles(found: list[dict]) -> list[dict]:
  """Line2D keywords (color, marker, linestyle, markerfacecolor) per curve, no two curves alike: colour and marker
  from the scheme (plots.scheme_styles), linestyle and filled or hollow marker from its place among the distinct
  (workdir, model, scaling, GPUs per node, modelled or measured) of the curves; where that is taken, the next
  free combination."""
  schemes = plots.scheme_styles(list(dict.fromkeys(c["scheme"] for c in found)))
  variants = list(dict.fromkeys(tuple(c[k] for k in VARIANT_KEY) for c in found))
  looks = [(ls, fill) for fill in (True, False) for ls in plots.LINESTYLES]
  taken, out = set(), []
  for c in found:
    colour, marker, _ = schemes[c["scheme"]]
    v = variants.index(tuple(c[k] for k in VARIANT_KEY))
    wanted = [(colour, marker, *looks[(v + i) % len(looks)]) for i in range(len(looks))]
    spare = ((col, m, *look) for m in plots.MARKERS for col in plots.COLOURS for look in looks)
    style = next(s for s in [*wanted, *spare] if s not in taken)
    taken.add(style)
    col, m, ls, fill = style
    out.append(dict(color=col, marker=m, linestyle=ls, markerfacecolor=col if fill else "none"))
  return out


def legend_labels(found: list[dict]) -> tuple[list[str], str]:
  """(a legend label per curve naming only what differs between curves, the facts all curves share)."""
  parts = [
    dict(
      name=c["name"],
      model=c["model"],
      scheme=c["scheme"],
      gpus=f"{c['gpus_per_node']} GPUs/node",
      scaling=c["scaling"],
      kind=f"{c['kind']} {c['where']}",
    )
    for c in found
  ]
  shared = [k for k in parts[0] if len({p[k] for p in parts}) == 1]
  labels = [", ".join(p[k] for k in p if k not in shared or k == "scheme") for p in parts]
  return labels, ", ".join(parts[0][k] for k in parts[0] if k in shared and k != "scheme")


def figure(found: list[dict], metric: str):
  """The curves against nodes (log 2, ticks at the node counts; each scheme's points moved sideways a little,
  plots.dodge, so that equal values stay visible), the metric on a log axis labelled by plots.field_label, each
  curve in its own `curve_styles` style, the legend below; facts shared by every curve in the title. Returns the
  matplotlib Figure."""
  from matplotlib.figure import Figure
  from matplotlib.ticker import FuncFormatter

  fig = Figure(figsize=(10, 6.5 + 0.12 * len(found)), layout="constrained")
  ax = fig.subplots()
  labels, shared = legend_labels(found)
  schemes = list(dict.fromkeys(c["scheme"] for c in found))
  for c, style, label in zip(found, curve_styles(found), labels):
    rank = schemes.index(c["scheme"])  # a scheme's curves move sideways together; later schemes' markers smaller
    shift = plots.dodge(rank, len(schemes), spread=0.04)
    nodes, values = zip(*c["points"])
    ax.plot(
      [n * shift for n in nodes], values, label=label, markersize=max(4.0, 9.0 - 1.2 * rank), zorder=2 + rank, **style
    )
  plots.node_axis(ax, [n for c in found for n, _ in c["points"]])
  if all(v > 0 for c in found for _, v in c["points"]):
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
  ax.set_ylabel(plots.field_label(metric))
  ax.set_title(
    "scaling curves of "
    + ", ".join(dict.fromkeys(c["name"] for c in found))
    + (f"\nevery curve: {shared}" if shared else ""),
    fontsize=10,
  )
  fig.legend(loc="outside lower center", fontsize=7, ncols=2 if len(found) > 6 else 1)
  return fig


def plot(found: list[dict], metric: str, path: str) -> None:
  """`figure` written as a PNG."""
  figure(found, metric).savefig(path, dpi=120)


def check(config) -> None:
  """The sweeps and their labels; errors name the field."""
  require(
    len(config.sweeps) > 0,
    "sweeps",
    config.sweeps,
    "sweep workdirs separated by commas, e.g. --config.sweeps=/tmp/sweep_h100,/tmp/sweep_p4d",
  )
  for sweep in config.sweeps:
    require(
      os.path.isfile(os.path.join(sweep, "results.json")) or os.path.isfile(os.path.join(sweep, "results.csv")),
      "sweeps",
      sweep,
      "sweep workdirs with results.json or results.csv (run the sweep first)",
    )
  require(
    not config.labels or len(config.labels) == len(config.sweeps),
    "labels",
    config.labels,
    f"empty (the directory names) or one label per sweep ({len(config.sweeps)})",
  )


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  found = curves(config.sweeps, config.labels, config.metric, config.schemes, config.scalings, config.models)
  if not found:
    have = "; ".join(f"{field}s: {', '.join(values)}" for field, values in available(config.sweeps).items())
    sys.exit(f"error: no rows with {config.metric!r} and the selection in {list(config.sweeps)} ({have})")
  print(format_table(found, config.metric))
  # compare_sweeps.png may go beside a compared sweep's files, else into a workdir no other program owns.
  workdir_guard.claim(workdir, "experiments.compare_sweeps", beside=config.sweeps)
  path = os.path.join(workdir, "compare_sweeps.png")
  plot(found, config.metric, path)
  print(f"wrote {path}")


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Comparison config file (configs/compare_sweeps.py).")
  _WORKDIR = cli.define_workdir("Directory for compare_sweeps.png.")
  cli.run(main)
