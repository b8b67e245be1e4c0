"""Scaling efficiency of a sweep's modelled rows (efficiency.png): each point's training throughput per GPU over that
of the same scheme's smallest mesh, 1.0 being ideal (linear) scaling. Throughput curves hide how far from linear a
scheme scales; per GPU, against the ideal line and from zero, the loss reads directly."""

from moejax.study import plots


def efficiency(rows: list[dict]) -> dict[tuple, list[tuple[int, float]]]:
  """{(model, scaling, gpus_per_node, scheme): [(nodes, efficiency)]} of the modelled rows (not 'measured'):
  (samples/s / devices) over that of the scheme's fewest nodes, by nodes."""
  curves = {}
  for r in rows:
    if r["label"] != "measured":
      key = (r["model"], r["scaling"], r["gpus_per_node"], r["scheme"])
      curves.setdefault(key, []).append((r["nodes"], r["samples_per_s"] / (r["nodes"] * r["gpus_per_node"])))
  out = {}
  for key, points in curves.items():
    points.sort()
    base = points[0][1]
    out[key] = [(n, per_gpu / base) for n, per_gpu in points]
  return out


def efficiency_figure(rows: list[dict], config=None):
  """One panel per (model, scaling, GPUs per node): each scheme's efficiency against nodes in its plots style, the
  ideal 1.0 dashed, y from 0; titles say how many micro batches a step accumulates (`plots.accumulation_note`).
  Returns the matplotlib Figure."""
  curves = efficiency(rows)
  order = {"weak": 0, "strong": 1}
  panels = sorted({key[:3] for key in curves}, key=lambda p: (p[0], order.get(p[1], 2), p[1], p[2]))
  styles = plots.scheme_styles(sorted({key[3] for key in curves}, key=plots._scheme_order))
  fig, axes = plots._grid(len(panels))
  for ax, panel in zip(axes, panels):
    schemes = sorted((key[3] for key in curves if key[:3] == panel), key=plots._scheme_order)
    nodes = sorted({n for s in schemes for n, _ in curves[panel + (s,)]})
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label=f"ideal: per-GPU throughput of {nodes[0]} node(s)")
    for rank, scheme in enumerate(schemes):
      colour, marker, linestyle = styles[scheme]
      shift = plots.dodge(rank, len(schemes))
      xs, ys = zip(*[(n * shift, e) for n, e in curves[panel + (scheme,)]])
      ax.plot(
        xs,
        ys,
        color=colour,
        marker=marker,
        linestyle=linestyle,
        label=plots.scheme_label(scheme),
        **plots.nested_marker(rank),
      )
    plots.node_axis(ax, nodes)
    top = max(e for s in schemes for _, e in curves[panel + (s,)])
    ax.set_ylim(0, 1.1 * max(1.0, top))
    ax.set_ylabel(f"per-GPU throughput / at {nodes[0]} node(s)")
    model, scaling, m = panel
    ours = [r for r in rows if (r["model"], r["scaling"], r["gpus_per_node"]) == panel]
    ax.set_title(f"{model}, {scaling} scaling, {m} GPUs/node\n{plots.accumulation_note(ours)}", fontsize=9)
    ax.legend(fontsize=7)
  topology, _ = plots._where(rows)
  fig.suptitle(
    f"Scaling efficiency, modelled with the cost model on {topology}: samples/s per GPU over the same "
    "scheme's on its fewest nodes (1.0 = linear scaling)\n"
    + "; ".join(plots.model_text(config, model) for model in dict.fromkeys(p[0] for p in panels))
    + plots.dedup_note({key[3] for key in curves}),
    fontsize=10,
  )
  return fig


def plot_efficiency(rows: list[dict], path: str, config=None) -> None:
  """`efficiency_figure` written as a PNG."""
  plots._save(efficiency_figure(rows, config), path)
