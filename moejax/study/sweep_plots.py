"""The scaling sweep's figures (`moejax.study.report` writes them): throughput.png (samples/s against nodes),
and breakdown.png (one MoE layer's forward time, part by part), in the style of `moejax.study.plots`
(measured.png: `moejax.study.measured_plots`)."""

import textwrap

from moejax.study.plots import (
  _grid,
  _save,
  _scheme_order,
  _where,
  accumulation_note,
  dedup_note,
  dodge,
  model_text,
  nested_marker,
  node_axis,
  paper_points,
  scheme_label,
  scheme_styles,
)

PARTS = (
  ("layer_inter_node_ms", "inter-node all-to-all"),
  ("layer_intra_node_ms", "intra-node all-to-all"),
  ("layer_expert_ms", "expert compute"),
  ("layer_other_ms", "other"),
  ("layer_control_ms", "control collectives"),
)


def _throughput_curves(ax, ours: list[dict], styles: dict, config, panel: tuple) -> None:
  """One panel's curves: per scheme its modelled line (moved sideways by `dodge`, extrapolated points ringed),
  its measured crosses and the papers' published stars (`paper_points`). panel: (model, scaling, GPUs per node)."""
  model, scaling, m = panel
  schemes = sorted({r["scheme"] for r in ours}, key=_scheme_order)
  extrapolated_drawn = False
  for rank, scheme in enumerate(schemes):
    colour, marker, linestyle = styles[scheme]
    mine = [r for r in ours if r["scheme"] == scheme]
    modelled = sorted((r["nodes"], r["samples_per_s"], r["label"]) for r in mine if r["label"] != "measured")
    measured = sorted((r["nodes"], r["samples_per_s"], r["device"]) for r in mine if r["label"] == "measured")
    if modelled:
      shift = dodge(rank, len(schemes))
      ax.plot(
        [n * shift for n, _, _ in modelled],
        [speed for _, speed, _ in modelled],
        color=colour,
        marker=marker,
        linestyle=linestyle,
        label=scheme_label(scheme),
        **nested_marker(rank),
      )
      beyond = [(n * shift, speed) for n, speed, label in modelled if label == "extrapolated"]
      if beyond:  # ringed: priced with terms fitted on fewer nodes or GPUs per node
        ax.plot(
          *zip(*beyond),
          linestyle="none",
          marker="o",
          markersize=17,
          markerfacecolor="none",
          markeredgecolor="0.55",
          linewidth=0,
          zorder=1,
          label="_" if extrapolated_drawn else "extrapolated beyond the calibrated meshes",
        )
        extrapolated_drawn = True
    if measured:
      nodes, speed, device = zip(*measured)
      ax.plot(nodes, speed, "x", color=colour, markersize=9, label=f"{scheme}, measured on {device[0]}")
      ax.set_yscale("log")  # measured devices may be far from the modelled cluster
    for point in paper_points(config, model, scaling, mine[0].get("topology") or ""):
      if (point["scheme"], point["gpus_per_node"]) == (scheme, m):
        ax.plot(
          point["nodes"],
          point["samples_per_s"],
          "*",
          color=colour,
          markersize=13,
          markeredgecolor="k",
          label=f"{scheme}, {point['source']}",
        )


def throughput_figure(rows: list[dict], config=None):
  """Samples/s against nodes: one panel per (model, scaling, GPUs per node), one line per scheme in its
  SCHEME_STYLES style (modelled; its points moved sideways by `dodge`, hollow markers nested; the legend says what
  a '_nodedup' scheme changes, `scheme_label`; extrapolated points ringed in grey), measured points as crosses in the
  scheme's colour, and (given the
  sweep's config) the papers' published points for the same setting as stars (`paper_points`). The title names the
  topology, the model, whether values are modelled or measured, and the facts every panel shares. Returns the
  matplotlib Figure."""
  order = {"weak": 0, "strong": 1}
  panels = sorted(
    {(r["model"], r["scaling"], r["gpus_per_node"]) for r in rows if r["label"] != "measured"},
    key=lambda p: (p[0], order.get(p[1], 2), p[1], p[2]),
  )
  models = list(dict.fromkeys(p[0] for p in panels))
  widths = sorted({p[2] for p in panels})
  styles = scheme_styles(sorted({r["scheme"] for r in rows}, key=_scheme_order))
  fig, axes = _grid(len(panels))
  for ax, (model, scaling, m) in zip(axes, panels):
    ours = [r for r in rows if (r["model"], r["scaling"], r["gpus_per_node"]) == (model, scaling, m)]
    _throughput_curves(ax, ours, styles, config, (model, scaling, m))
    node_axis(ax, [r["nodes"] for r in ours])
    has_measured = any(r["label"] == "measured" for r in ours)
    ax.set_ylabel("samples/s (lines modelled, crosses measured)" if has_measured else "samples/s (modelled)")
    title = f"{model}, {scaling} scaling" + ("" if len(widths) == 1 else f", {m} GPUs/node")
    if scaling == "strong" and config is not None and "global_batch" in config:
      title += f" (global batch {config.global_batch})"
    elif scaling == "weak":
      title += " (fixed micro batch per GPU)"
    note = accumulation_note(ours)  # strong beats weak on few nodes by accumulating: say so where it shows
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    if ax.get_yscale() == "linear":
      ax.set_ylim(bottom=0)  # from zero: a 5% gap looks like one
    ax.legend(fontsize=7)
  topology, measured = _where(rows)
  shared = f", {widths[0]} GPUs/node" if len(widths) == 1 else ""
  fig.suptitle(
    f"Training throughput, modelled with the cost model on {topology}{shared}{measured}\n"
    + "; ".join(model_text(config, model) for model in models)
    + "\neach scheme's points are moved sideways a little, so that equal values stay visible"
    + dedup_note({r["scheme"] for r in rows}),
    fontsize=10,
  )
  return fig


def plot_throughput(rows: list[dict], path: str, config=None) -> None:
  """`throughput_figure` written as a PNG."""
  _save(throughput_figure(rows, config), path)


def breakdown_figure(rows: list[dict], config=None):
  """Stacked per-layer forward time (SMILE Table 3 / Fig. 9): one panel per model, one bar per
  (mesh, scheme), modelled, then measured where there are measured points. The layer does not
  depend on the scaling, so one scaling's rows are drawn. The title says the times are modelled (cost model)
  and on which topology. Returns the matplotlib Figure."""
  rows = [r for r in rows if r["scaling"] == rows[0]["scaling"]]
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = _grid(len(models), width=max(6.5, 0.35 * len(rows) / len(models)), height=4.8)
  for ax, model in zip(axes, models):
    bars = sorted(
      (r for r in rows if r["model"] == model),
      key=lambda r: (r["label"] == "measured", r["gpus_per_node"], r["nodes"], _scheme_order(r["scheme"])),
    )
    bottom = [0.0] * len(bars)
    for field, name in PARTS:
      # a measured remainder is negative when phases add up to more; measured rows hold no control part (it is in
      # their remainder)
      heights = [max(r.get(field, 0.0), 0.0) for r in bars]
      ax.bar(range(len(bars)), heights, bottom=bottom, label=name)
      bottom = [b + h for b, h in zip(bottom, heights)]
    overlapped = [(i, r["layer_ms"]) for i, r in enumerate(bars) if r.get("layer_hidden_ms", 0) > 0]
    if overlapped:  # overlap schedules: the parts run partly at once, so the layer is shorter than their sum
      ax.plot(*zip(*overlapped), "r_", markersize=14, markeredgewidth=2, label="modelled layer with overlap")
    measured = [(i, r["layer_ms"]) for i, r in enumerate(bars) if r["label"] == "measured"]
    if measured:  # the phases were timed apart, so the whole layer is drawn as well
      ax.plot(*zip(*measured), "k_", markersize=14, markeredgewidth=2, label="measured whole layer")
    for i in range(1, len(bars)):  # a faint line between meshes
      if (bars[i]["nodes"], bars[i]["gpus_per_node"], bars[i]["label"]) != (
        bars[i - 1]["nodes"],
        bars[i - 1]["gpus_per_node"],
        bars[i - 1]["label"],
      ):
        ax.axvline(i - 0.5, color="0.8", linewidth=0.8, zorder=0)
    ax.set_xticks(
      range(len(bars)),
      [
        f"{r['nodes']}x{r['gpus_per_node']} {r['scheme']}"
        + (f" measured on {r['device']}" if r["label"] == "measured" else "")
        for r in bars
      ],
      rotation=90,
      fontsize=7,
    )
    ax.set_xlabel("nodes x GPUs per node, scheme")
    ax.set_ylabel("ms per MoE layer forward (modelled)" if not measured else "ms per MoE layer forward")
    ax.set_title(textwrap.fill(model_text(config, model), 90), fontsize=9)
    ax.legend(fontsize=7)
  topology, measured = _where(rows)
  fig.suptitle(
    f"One MoE layer's forward time for one micro batch,\nmodelled with the cost model on {topology}"
    f"{measured}" + dedup_note({r["scheme"] for r in rows}),
    fontsize=10,
  )
  return fig


def plot_breakdown(rows: list[dict], path: str, config=None) -> None:
  """`breakdown_figure` written as a PNG."""
  _save(breakdown_figure(rows, config), path)
