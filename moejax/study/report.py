"""Results of a scaling sweep (`moejax.study.sweep`): CSV, JSON, a printed comparison, and the plots (`plots`)."""

import csv
import json
import math
import os

from moejax.study import plots

COLUMNS = ("label", "model", "scaling", "nodes", "gpus_per_node", "devices", "scheme", "routing", "path",
           "collective", "choices_per_token", "capacity_factor", "dedup", "dispatch_dtype", "combine_dtype",
           "tokens_per_gpu", "global_batch", "accumulation", "sim_tokens_per_gpu", "token_scale", "sim_dropped_fraction",
           "expert_load_imbalance", "inter_node_mb_per_gpu", "intra_node_mb_per_gpu", "dispatch_bytes_per_row",
           "combine_bytes_per_row", "layer_inter_node_ms", "layer_intra_node_ms",
           "layer_expert_ms", "layer_other_ms", "layer_hidden_ms", "comm_hidden_fraction", "esp_choice", "layer_ms",
           "grad_sync_ms", "tensor_parallel_ms", "step_s", "samples_per_s",
           "topology", "device_tflops", "rate_source", "layer_ms_min", "step_s_min", "loss_first", "loss_last",
           "repeats", "device", "jax_version", "key")
LAYER_COLUMNS = {"layer_inter_node_ms": "inter", "layer_intra_node_ms": "intra", "layer_expert_ms": "expert",
                 "layer_other_ms": "other", "layer_hidden_ms": "hidden", "layer_ms": "layer"}
def write_csv(rows: list[dict], path: str) -> None:
  """One line per row; fields a row lacks (e.g. measured rows have no modelled traffic) are left empty."""
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


def write_json(rows: list[dict], config, path: str) -> None:
  with open(path, "w") as f:
    json.dump({"config": config.to_dict(), "rows": rows}, f, indent=1)


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
  scaling and the ratio to 'switch' on the same mesh; then, where points were measured, the
  measured layer forward (ms) and samples/s per scaling. Every column's numbers share one format and width
  (`fixed_column`)."""
  modelled = [r for r in rows if r["label"] == "modelled"]
  measured = {(r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r
              for r in rows if r["label"] == "measured"}
  scalings = list(dict.fromkeys(r["scaling"] for r in modelled))
  by_point = {(r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r for r in modelled}
  models = list(dict.fromkeys(r["model"] for r in modelled))
  keys = sorted(dict.fromkeys(k[:4] for k in by_point), key=lambda k: models.index(k[0]))
  firsts = [by_point[key + (scalings[0],)] for key in keys]
  columns = [("model", [k[0] for k in keys], "<"), ("mesh", [f"{k[1]}x{k[2]}" for k in keys], ">"),
             ("scheme", [k[3] for k in keys], "<")]
  columns += [(name, fixed_column([r.get(field, 0.0) for r in firsts], decimals=3), ">")
              for field, name in LAYER_COLUMNS.items()]
  for scaling in scalings:
    points = [by_point.get(key + (scaling,)) for key in keys]
    switches = [by_point.get(key[:3] + ("switch", scaling)) for key in keys]
    columns.append((f"{scaling} samples/s", fixed_column([p["samples_per_s"] if p else None for p in points]), ">"))
    ratios = fixed_column([p["samples_per_s"] / s["samples_per_s"] if p and s else None
                           for p, s in zip(points, switches)], decimals=2)
    columns.append(("vs switch", [f"{c}x" if c.strip() else f"{c} " for c in ratios], ">"))
  head = "modelled per-layer forward (ms) and training throughput"
  if measured:
    devices = ", ".join(sorted({r["device"] for r in measured.values()}))
    head += f"; measured layer forward (ms) and samples/s on {devices}"
    timed = [[measured.get(key + (scaling,)) for scaling in scalings] for key in keys]
    layers = [next((r["layer_ms"] for r in line if r), None) for line in timed]
    columns.append(("measured", fixed_column(layers, decimals=3), ">"))
    columns += [(f"measured {scaling}", fixed_column([line[i]["samples_per_s"] if line[i] else None for line in timed]),
                 ">") for i, scaling in enumerate(scalings)]
  return "\n".join([head, *text_table(columns)])


def write_all(rows: list[dict], config, workdir: str) -> dict[str, str]:
  """results.csv, results.json, throughput.png and breakdown.png in workdir; returns their paths."""
  paths = {name: os.path.join(workdir, name)
           for name in ("results.csv", "results.json", "throughput.png", "breakdown.png")}
  write_csv(rows, paths["results.csv"])
  write_json(rows, config, paths["results.json"])
  plots.plot_throughput(rows, paths["throughput.png"], config)
  plots.plot_breakdown(rows, paths["breakdown.png"], config)
  return paths
