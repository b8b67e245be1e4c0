"""Results of a scaling sweep (`moejax.study.sweep`): CSV, JSON, PNG plots and a printed comparison."""

import csv
import json
import os

COLUMNS = ("label", "model", "scaling", "nodes", "gpus_per_node", "devices", "scheme", "routing", "transport",
           "choices_per_token", "capacity_factor", "tokens_per_gpu", "global_batch", "accumulation",
           "sim_tokens_per_gpu", "token_scale", "sim_dropped_fraction", "expert_load_imbalance",
           "inter_node_mb_per_gpu", "intra_node_mb_per_gpu", "layer_inter_node_ms", "layer_intra_node_ms",
           "layer_expert_ms", "layer_other_ms", "layer_hidden_ms", "comm_hidden_fraction", "esp_choice", "layer_ms",
           "grad_sync_ms", "tensor_parallel_ms", "step_s", "samples_per_s",
           "topology", "device_tflops", "rate_source", "layer_ms_min", "step_s_min", "loss_first", "loss_last",
           "repeats", "device", "jax_version", "key")
LAYER_COLUMNS = {"layer_inter_node_ms": "inter", "layer_intra_node_ms": "intra", "layer_expert_ms": "expert",
                 "layer_other_ms": "other", "layer_hidden_ms": "hidden", "layer_ms": "layer"}
PARTS = (("layer_inter_node_ms", "inter-node all-to-all"), ("layer_intra_node_ms", "intra-node all-to-all"),
         ("layer_expert_ms", "expert compute"), ("layer_other_ms", "other"))


# Published throughputs drawn beside the modelled curves where a sweep's point is the paper's setting: topology
# preset (its name, overrides allowed), GPUs per node, nodes, the model's shape, the scalings whose point at that
# many nodes is the paper's run, and the global batch that run used.
_SMILE_TABLE2 = "SMILE Table 2 (16 P4d nodes, global batch 16384)"
PAPER_POINTS = tuple(
    dict(topology="p4d_efa", gpus_per_node=8, nodes=16, global_batch=16384, scalings=scalings,
         shape=dict(d_model=d, d_ff=f, layers=layers, micro_batch=micro), scheme=scheme, samples_per_s=value,
         source=_SMILE_TABLE2)
    # micro batch 128 x 128 GPUs = 16384: one micro batch a step, so weak and strong meet at 16 nodes; the larger
    # models' micro batch 64 needs two micro batches a step, the strong setting with global_batch 16384.
    for d, f, layers, micro, scalings, values in (
        (768, 3072, 12, 128, ("weak", "strong"), {"switch": 8112.0, "smile": 20011.0}),
        (1024, 4096, 24, 64, ("strong",), {"switch": 4001.0, "smile": 6829.0}),
        (1600, 6400, 36, 64, ("strong",), {"switch": 889.0, "smile": 2223.0}))
    for scheme, value in values.items())


def paper_points(config, model: str, scaling: str, topology_name: str) -> list[dict]:
  """The PAPER_POINTS a sweep with `config` has a modelled point for: same topology preset, model shape and,
  for strong scaling, global batch."""
  if config is None or model not in config.models:
    return []
  shape = config.models[model]
  return [p for p in PAPER_POINTS
          if topology_name.partition("+")[0] == p["topology"] and scaling in p["scalings"]
          and p["gpus_per_node"] in tuple(config.gpus_per_node) and p["nodes"] in tuple(config.nodes)
          and all(shape.get(k) == v for k, v in p["shape"].items())
          and (scaling == "weak" or config.global_batch == p["global_batch"])]


def write_csv(rows: list[dict], path: str) -> None:
  """One line per row; fields a row lacks (e.g. measured rows have no modelled traffic) are left empty."""
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


def write_json(rows: list[dict], config, path: str) -> None:
  with open(path, "w") as f:
    json.dump({"config": config.to_dict(), "rows": rows}, f, indent=1)


def _grid(count: int, width: float = 5.5):
  """A figure with `count` panels of `width` inches, three per line."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  cols = min(count, 3)
  rows = -(-count // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 4.2 * rows), squeeze=False)
  for ax in axes.flat[count:]:
    ax.set_visible(False)
  return plt, fig, axes.flat


def _save(plt, fig, path: str) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_throughput(rows: list[dict], path: str, config=None) -> None:
  """Samples/s against nodes: one panel per (model, scaling), one line per scheme and GPUs per node
  (modelled), measured points as crosses in the line's colour, and (given the sweep's config) the papers'
  published points for the same setting as stars (`paper_points`)."""
  panels = sorted({(r["model"], r["scaling"]) for r in rows if r["label"] == "modelled"})
  plt, fig, axes = _grid(len(panels))
  for ax, (model, scaling) in zip(axes, panels):
    lines = sorted({(r["scheme"], r["gpus_per_node"]) for r in rows if (r["model"], r["scaling"]) == (model, scaling)})
    for scheme, m in lines:
      ours = [r for r in rows if (r["model"], r["scaling"], r["scheme"], r["gpus_per_node"]) == (model, scaling, scheme, m)]
      modelled = sorted((r["nodes"], r["samples_per_s"]) for r in ours if r["label"] == "modelled")
      measured = sorted((r["nodes"], r["samples_per_s"], r["device"]) for r in ours if r["label"] == "measured")
      color = ax.plot(*zip(*modelled), marker="o", label=f"{scheme} ({m} GPUs/node)")[0].get_color()
      if measured:
        nodes, speed, device = zip(*measured)
        ax.plot(nodes, speed, "x", color=color, markersize=9, label=f"{scheme} ({m} GPUs/node), measured on {device[0]}")
        ax.set_yscale("log")  # measured devices may be far from the modelled cluster
      for point in paper_points(config, model, scaling, ours[0].get("topology") or ""):
        if (point["scheme"], point["gpus_per_node"]) == (scheme, m):
          ax.plot(point["nodes"], point["samples_per_s"], "*", color=color, markersize=13, markeredgecolor="k",
                  label=f"{scheme}, {point['source']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    has_measured = any(r["label"] == "measured" and (r["model"], r["scaling"]) == (model, scaling) for r in rows)
    ax.set_ylabel("samples/s (lines modelled, crosses measured)" if has_measured else "samples/s (modelled)")
    ax.set_title(f"{model}, {scaling} scaling")
    ax.legend(fontsize=7)
  _save(plt, fig, path)


def plot_breakdown(rows: list[dict], path: str) -> None:
  """Stacked per-layer forward time (SMILE Table 3 / Fig. 9): one panel per model, one bar per
  (mesh, scheme), modelled, then measured where there are measured points. The layer does not
  depend on the scaling, so one scaling's rows are drawn."""
  rows = [r for r in rows if r["scaling"] == rows[0]["scaling"]]
  models = list(dict.fromkeys(r["model"] for r in rows))
  plt, fig, axes = _grid(len(models), width=max(5.5, 0.3 * len(rows) / len(models)))
  for ax, model in zip(axes, models):
    bars = sorted((r for r in rows if r["model"] == model),
                  key=lambda r: (r["label"] == "measured", r["gpus_per_node"], r["nodes"]))
    bottom = [0.0] * len(bars)
    for field, name in PARTS:
      heights = [max(r[field], 0.0) for r in bars]  # a measured remainder is negative when phases add up to more
      ax.bar(range(len(bars)), heights, bottom=bottom, label=name)
      bottom = [b + h for b, h in zip(bottom, heights)]
    overlapped = [(i, r["layer_ms"]) for i, r in enumerate(bars) if r.get("layer_hidden_ms", 0) > 0]
    if overlapped:  # overlap schedules: the parts run partly at once, so the layer is shorter than their sum
      ax.plot(*zip(*overlapped), "r_", markersize=14, markeredgewidth=2, label="modelled layer with overlap")
    measured = [(i, r["layer_ms"]) for i, r in enumerate(bars) if r["label"] == "measured"]
    if measured:  # the phases were timed apart, so the whole layer is drawn as well
      ax.plot(*zip(*measured), "k_", markersize=14, markeredgewidth=2, label="measured whole layer")
    ax.set_xticks(range(len(bars)), [f"{r['nodes']}x{r['gpus_per_node']} {r['scheme']}"
                                     + (f" measured on {r['device']}" if r["label"] == "measured" else "")
                                     for r in bars], rotation=90, fontsize=7)
    ax.set_ylabel("ms per MoE layer forward")
    ax.set_title(f"{model}: one layer, one micro batch")
    ax.legend(fontsize=7)
  _save(plt, fig, path)


def comparison_table(rows: list[dict]) -> str:
  """One line per (model, mesh, scheme): the modelled layer breakdown (ms), modelled samples/s per
  scaling and the ratio to 'switch' on the same mesh; then, where points were measured, the
  measured layer forward (ms) and samples/s per scaling."""
  modelled = [r for r in rows if r["label"] == "modelled"]
  measured = {(r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r
              for r in rows if r["label"] == "measured"}
  scalings = list(dict.fromkeys(r["scaling"] for r in modelled))
  by_point = {(r["model"], r["nodes"], r["gpus_per_node"], r["scheme"], r["scaling"]): r for r in modelled}
  models = list(dict.fromkeys(r["model"] for r in modelled))
  keys = sorted(dict.fromkeys(k[:4] for k in by_point), key=lambda k: models.index(k[0]))
  head = f"{'model':10s} {'mesh':>6s} {'scheme':14s}" + "".join(f" {name:>8s}" for name in LAYER_COLUMNS.values())
  head += "".join(f" {s + ' samples/s':>18s} {'vs switch':>9s}" for s in scalings)
  if measured:
    devices = ", ".join(sorted({r["device"] for r in measured.values()}))
    head += f" {'measured':>9s}" + "".join(f" {'measured ' + s:>14s}" for s in scalings)
  lines = ["modelled per-layer forward (ms) and training throughput"
           + (f"; measured layer forward (ms) and samples/s on {devices}" if measured else ""), head]
  for model, n, m, scheme in keys:
    first = by_point[model, n, m, scheme, scalings[0]]
    line = f"{model:10s} {f'{n}x{m}':>6s} {scheme:14s}" + "".join(f" {first.get(field, 0.0):8.3f}" for field in LAYER_COLUMNS)
    for scaling in scalings:
      row, switch = by_point.get((model, n, m, scheme, scaling)), by_point.get((model, n, m, "switch", scaling))
      line += f" {row['samples_per_s']:18.5g}" if row else f" {'':18s}"
      line += f" {row['samples_per_s'] / switch['samples_per_s']:8.2f}x" if row and switch else f" {'':9s}"
    if measured:
      timed = [measured.get((model, n, m, scheme, scaling)) for scaling in scalings]
      layer = next((r["layer_ms"] for r in timed if r), None)
      line += f" {layer:9.3f}" if layer is not None else f" {'':9s}"
      line += "".join(f" {r['samples_per_s']:14.5g}" if r else f" {'':14s}" for r in timed)
    lines.append(line)
  return "\n".join(lines)


def write_all(rows: list[dict], config, workdir: str) -> dict[str, str]:
  """results.csv, results.json, throughput.png and breakdown.png in workdir; returns their paths."""
  paths = {name: os.path.join(workdir, name)
           for name in ("results.csv", "results.json", "throughput.png", "breakdown.png")}
  write_csv(rows, paths["results.csv"])
  write_json(rows, config, paths["results.json"])
  plot_throughput(rows, paths["throughput.png"], config)
  plot_breakdown(rows, paths["breakdown.png"])
  return paths
