"""Results of a scaling sweep (`moejax.study.sweep`): CSV, JSON, a printed comparison, and the plots (`sweep_plots`)."""

import csv
import json
import math
import os

from moejax.cost import topology as topology_lib
from moejax.study import efficiency, measured_plots, plots, sweep_plots

COLUMNS = (
  "label",
  "model",
  "scaling",
  "nodes",
  "gpus_per_node",
  "devices",
  "hosts",
  "scheme",
  "routing",
  "path",
  "collective",
  "choices_per_token",
  "capacity_factor",
  "dedup",
  "dispatch_dtype",
  "combine_dtype",
  "tokens_per_gpu",
  "global_batch",
  "accumulation",
  "sim_tokens_per_gpu",
  "token_scale",
  "sim_dropped_fraction",
  "expert_load_imbalance",
  "inter_node_mb_per_gpu",
  "intra_node_mb_per_gpu",
  "dispatch_bytes_per_row",
  "combine_bytes_per_row",
  "layer_inter_node_ms",
  "layer_intra_node_ms",
  "layer_expert_ms",
  "layer_other_ms",
  "layer_control_ms",
  "layer_hidden_ms",
  "comm_hidden_fraction",
  "esp_choice",
  "layer_ms",
  "grad_sync_ms",
  "tensor_parallel_ms",
  "step_s",
  "samples_per_s",
  "topology",
  "device_tflops",
  "rate_source",
  "layer_ms_min",
  "step_s_min",
  "loss_first",
  "loss_last",
  "repeats",
  "layer_repeats",
  "device",
  "jax_version",
  "modelled_layer_ms",
  "layer_error",
  "modelled_step_s",
  "step_error",
  "priced_layer_ms",
  "priced_layer_collectives_ms",
  "priced_layer_compute_ms",
  "priced_layer_error",
  "priced_step_s",
  "priced_step_error",
  "key",
)
LAYER_COLUMNS = {
  "layer_inter_node_ms": "inter",
  "layer_intra_node_ms": "intra",
  "layer_expert_ms": "expert",
  "layer_other_ms": "other",
  "layer_control_ms": "control",
  "layer_hidden_ms": "hidden",
  "layer_ms": "layer",
}
# The fields that name a point: a measured row and the modelled row of the same point share them.
POINT_FIELDS = ("model", "scaling", "nodes", "gpus_per_node", "scheme")


def with_model_error(rows: list[dict]) -> list[dict]:
  """`rows` with each measured row given its point's modelled (or extrapolated) values and the model's error
  there: modelled_layer_ms, layer_error = modelled / measured - 1 (the layer forward), modelled_step_s and
  step_error (the training step). A measured row without a modelled counterpart is left as it is."""
  modelled = {tuple(r[f] for f in POINT_FIELDS): r for r in rows if r["label"] != "measured"}
  out = []
  for row in rows:
    model = modelled.get(tuple(row[f] for f in POINT_FIELDS)) if row["label"] == "measured" else None
    if model:
      row = dict(
        row,
        modelled_layer_ms=model["layer_ms"],
        layer_error=model["layer_ms"] / row["layer_ms"] - 1,
        modelled_step_s=model["step_s"],
        step_error=model["step_s"] / row["step_s"] - 1,
      )
    out.append(row)
  return out


def calibration_text(calibrated) -> str:
  """The calibration a sweep priced with (`moejax.cost.fitted.Calibration`): each fitted term with its value and
  the fit's residual, the held-out exchanges' errors, the timed rate and non-expert cost, and what was timed."""
  fit = calibrated.fit
  lines = [
    f"calibrated topology {calibrated.topology.name}: fitted on one-axis all-to-alls, rms relative residual "
    f"{fit['rms_relative']:.1%}; timed up to {calibrated.nodes} node(s) x {calibrated.gpus_per_node} devices "
    "(beyond: rows 'extrapolated')"
  ]
  for term in fit["fitted"]:
    scale, unit = topology_lib.UNITS[term]
    lines.append(f"  {term:14s} {fit['values'][term] / scale:10.4g} {unit:5s} fitted")
  for e in fit["held_out"]:
    lines.append(
      f"  held out: all_to_all along both axes on {e['nodes']}x{e['gpus_per_node']}, {e['rows_per_peer']} "
      f"rows per peer: measured {e['measured_s'] * 1e6:.1f} us, model {e['model_s'] * 1e6:.1f} us "
      f"({e['error']:+.1%})"
    )
  if calibrated.rate:
    lines.append(f"  device rate    {calibrated.rate[0] / 1e12:10.4g} TFLOP/s {calibrated.rate[1]}")
  if calibrated.row_cost:
    lines.append(f"  non-expert     {calibrated.row_cost.seconds_per_byte:10.4g} s/byte {calibrated.row_cost.source}")
  return "\n".join(lines)


def temporary(path: str) -> str:
  """Where a result file is written before it is renamed to `path` (os.replace), so that a sweep killed while
  writing it leaves the file before, never a cut one: 'results.tmp.csv' (the extension kept, which matplotlib
  reads the format from)."""
  root, extension = os.path.splitext(path)
  return f"{root}.tmp{extension}"


def write_csv(rows: list[dict], path: str) -> None:
  """One line per row; fields a row lacks (e.g. measured rows have no modelled traffic) are left empty."""
  with open(temporary(path), "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  os.replace(temporary(path), path)


def write_json(rows: list[dict], config, path: str) -> None:
  with open(temporary(path), "w") as f:
    json.dump({"config": config.to_dict(), "rows": rows}, f, indent=1)
  os.replace(temporary(path), path)


def fixed_column(values, digits: int = 5, max_decimals: int = 3, decimals: int | None = None) -> list[str]:
  """One table column's numbers (None: an empty cell) as strings of one width, all with the same count of
  decimals and never in exponent notation: `decimals`, else enough for `digits` significant digits of the
  column's smallest nonzero magnitude, at most `max_decimals`."""
  present = [abs(v) for v in values if v is not None and v != 0 and math.isfinite(v)]
  if decimals is None:
    smallest = min(present, default=1.0)
    decimals = min(max_decimals, max(0, digits - 1 - math.floor(math.log10(smallest))))
  cells = [f"{v:.{decimals}f}" if v is not None else "" for v in values]
  width = max(map(len, cells), default=0)
  return [c.rjust(width) for c in cells]


def text_table(columns: list[tuple[str, list[str], str]]) -> list[str]:
  """Lines of a table from (header, cells, align '<' or '>') columns, each as wide as its widest cell or header,
  separated by two spaces."""
  widths = [max([len(head), *map(len, cells)]) for head, cells, _ in columns]
  lines = ["  ".join(f"{head:{align}{w}s}" for (head, _, align), w in zip(columns, widths)).rstrip()]
  for i in range(len(columns[0][1])):
    lines.append("  ".join(f"{cells[i]:{align}{w}s}" for (_, cells, align), w in zip(columns, widths)).rstrip())
  return lines


def comparison_table(rows: list[dict]) -> str:
  """One line per (model, mesh, scheme): the modelled layer breakdown (ms), modelled samples/s per
  scaling and the ratio to 'switch' on the same mesh (a mesh marked '*': extrapolated beyond a calibration's timed
  meshes); then, where points were measured, the measured layer forward (ms) and the model's error there, and the
  measured samples/s per scaling with the model's error on the step (`with_model_error`), each followed by the
  error of the timed program's own price where the sweep priced it ('priced': measure.price_program). Every
  column's numbers share one format and width (`fixed_column`)."""
  rows = with_model_error(rows)
  modelled = [r for r in rows if r["label"] != "measured"]
  measured = {
    (r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r for r in rows if r["label"] == "measured"
  }
  scalings = list(dict.fromkeys(r["scaling"] for r in modelled))
  by_point = {(r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r for r in modelled}
  models = list(dict.fromkeys(r["model"] for r in modelled))
  keys = sorted(dict.fromkeys(k[:4] for k in by_point), key=lambda k: models.index(k[0]))
  firsts = [by_point[key + (scalings[0],)] for key in keys]
  marks = ["*" if r["label"] == "extrapolated" else "" for r in firsts]
  columns = [
    ("model", [k[0] for k in keys], "<"),
    ("mesh", [f"{k[1]}x{k[2]}{x}" for k, x in zip(keys, marks)], ">"),
    ("scheme", [k[3] for k in keys], "<"),
  ]
  columns += [
    (name, fixed_column([r.get(field, 0.0) for r in firsts], decimals=3), ">")
    for field, name in layer_columns(firsts).items()
  ]
  for scaling in scalings:
    points = [by_point.get(key + (scaling,)) for key in keys]
    switches = [by_point.get(key[:3] + ("switch", scaling)) for key in keys]
    columns.append((f"{scaling} samples/s", fixed_column([p["samples_per_s"] if p else None for p in points]), ">"))
    ratios = fixed_column(
      [p["samples_per_s"] / s["samples_per_s"] if p and s else None for p, s in zip(points, switches)], decimals=2
    )
    columns.append(("vs switch", [f"{c}x" if c.strip() else f"{c} " for c in ratios], ">"))
  head = "modelled per-layer forward (ms) and training throughput"
  if measured:
    devices = ", ".join(sorted({r["device"] for r in measured.values()}))
    head += f"; measured layer forward (ms) and samples/s on {devices}, the model's error (modelled / measured - 1)"
    priced = any("priced_layer_error" in r for r in measured.values())
    if priced:
      head += " and the timed program's priced error (terms timed on its mesh)"
    timed = [[measured.get(key + (scaling,)) for scaling in scalings] for key in keys]
    first = [next((r for r in line if r), None) for line in timed]
    columns.append(("measured", fixed_column([r and r["layer_ms"] for r in first], decimals=3), ">"))
    columns.append(("error", _errors([r and r.get("layer_error") for r in first]), ">"))
    if priced:
      columns.append(("priced", _errors([r and r.get("priced_layer_error") for r in first]), ">"))
    for i, scaling in enumerate(scalings):
      columns.append(
        (f"measured {scaling}", fixed_column([line[i] and line[i]["samples_per_s"] for line in timed]), ">")
      )
      columns.append(("error", _errors([line[i] and line[i].get("step_error") for line in timed]), ">"))
      if priced:
        columns.append(("priced", _errors([line[i] and line[i].get("priced_step_error") for line in timed]), ">"))
  lines = [head, *text_table(columns), *accumulation_lines(modelled)]
  if any(marks):
    lines.append("* extrapolated: more nodes or GPUs per node than the calibration timed")
  return "\n".join(lines)


def layer_columns(rows: list[dict]) -> dict[str, str]:
  """LAYER_COLUMNS less 'hidden' where no row's schedule hides any communication (it would be 0 everywhere)."""
  hidden = any(r.get("layer_hidden_ms") for r in rows)
  return {field: name for field, name in LAYER_COLUMNS.items() if hidden or field != "layer_hidden_ms"}


def accumulation_lines(rows: list[dict]) -> list[str]:
  """Under the table, per (model, GPUs per node) whose strong scaling accumulates micro batches: how many, the
  difference from weak scaling that only results.csv's accumulation column showed."""
  lines = []
  for model, m in dict.fromkeys((r["model"], r["gpus_per_node"]) for r in rows):
    strong = [r for r in rows if (r["model"], r["gpus_per_node"], r["scaling"]) == (model, m, "strong")]
    if any(r.get("accumulation", 1) > 1 for r in strong):
      lines.append(
        f"strong scaling of {model} on {m} GPUs/node: {plots.accumulation_note(strong)} (one "
        "gradient sync a step); weak scaling: 1, so strong is faster where it accumulates"
      )
  return lines


def _errors(values) -> list[str]:
  """Relative errors as signed percentages ('' where there is none)."""
  return ["" if v is None else f"{v:+.0%}" for v in values]


def write_all(rows: list[dict], config, workdir: str) -> dict[str, str]:
  """results.csv, results.json, throughput.png, efficiency.png (`efficiency`) and breakdown.png in workdir, and
  measured.png where points were measured (`measured_plots.measured_figure`); the measured rows with the model's error
  (`with_model_error`); each written to a temporary file and renamed over the one before (`temporary`). Returns the
  paths."""
  rows = with_model_error(rows)
  names = ["results.csv", "results.json", "throughput.png", "efficiency.png", "breakdown.png"]
  if any(r["label"] == "measured" for r in rows):
    names.append("measured.png")
  paths = {name: os.path.join(workdir, name) for name in names}
  write_csv(rows, paths["results.csv"])
  write_json(rows, config, paths["results.json"])
  plots = {
    "throughput.png": sweep_plots.plot_throughput,
    "efficiency.png": efficiency.plot_efficiency,
    "breakdown.png": sweep_plots.plot_breakdown,
    "measured.png": measured_plots.plot_measured,
  }
  for name, plot in plots.items():
    if name in paths:  # each figure drawn to a temporary file and renamed: never a cut one
      plot(rows, temporary(paths[name]), config)
      os.replace(temporary(paths[name]), paths[name])
  return paths
