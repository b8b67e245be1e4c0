"""The scaling sweep's plots (throughput.png, breakdown.png) and the style every sweep plot shares: one (colour,
marker, linestyle) per scheme, node counts as ticks, labels with units (also `experiments.compare_sweeps`)."""

import textwrap

from moejax.study.points import NODEDUP

PARTS = (
  ("layer_inter_node_ms", "inter-node all-to-all"),
  ("layer_intra_node_ms", "intra-node all-to-all"),
  ("layer_expert_ms", "expert compute"),
  ("layer_other_ms", "other"),
)


# Published throughputs drawn beside the modelled curves where a sweep's point is the paper's setting: topology
# preset (its name, overrides allowed), GPUs per node, nodes, the model's shape, the scalings whose point at that
# many nodes is the paper's run, and the global batch that run used.
_SMILE_TABLE2 = "SMILE Table 2 (16 P4d nodes, global batch 16384)"
PAPER_POINTS = tuple(
  dict(
    topology="p4d_efa",
    gpus_per_node=8,
    nodes=16,
    global_batch=16384,
    scalings=scalings,
    shape=dict(d_model=d, d_ff=f, layers=layers, micro_batch=micro),
    scheme=scheme,
    samples_per_s=value,
    source=_SMILE_TABLE2,
  )
  # micro batch 128 x 128 GPUs = 16384: one micro batch a step, so weak and strong meet at 16 nodes; the larger
  # models' micro batch 64 needs two micro batches a step, the strong setting with global_batch 16384.
  for d, f, layers, micro, scalings, values in (
    (768, 3072, 12, 128, ("weak", "strong"), {"switch": 8112.0, "smile": 20011.0}),
    (1024, 4096, 24, 64, ("strong",), {"switch": 4001.0, "smile": 6829.0}),
    (1600, 6400, 36, 64, ("strong",), {"switch": 889.0, "smile": 2223.0}),
  )
  for scheme, value in values.items()
)


def paper_points(config, model: str, scaling: str, topology_name: str) -> list[dict]:
  """The PAPER_POINTS a sweep with `config` has a modelled point for: same topology preset, model shape and,
  for strong scaling, global batch."""
  if config is None or model not in config.models:
    return []
  shape = config.models[model]
  return [
    p
    for p in PAPER_POINTS
    if topology_name.partition("+")[0] == p["topology"]
    and scaling in p["scalings"]
    and p["gpus_per_node"] in tuple(config.gpus_per_node)
    and p["nodes"] in tuple(config.nodes)
    and all(shape.get(k) == v for k, v in p["shape"].items())
    and (scaling == "weak" or config.global_batch == p["global_batch"])
  ]


# One style per scheme, (colour, marker, linestyle), the same in every plot. Markers are drawn hollow and smaller
# the later a scheme comes in a panel, so that points of schemes whose curves coincide nest instead of hiding each
# other; no two schemes share a (colour, marker) pair. A scheme without dedup ('<scheme>_nodedup') takes its
# scheme's colour with another marker and a dashed line.
SCHEME_STYLES = {
  "switch": ("tab:blue", "o", "-"),
  "flat_dropless": ("tab:orange", "s", "--"),
  "hierarchical": ("tab:green", "^", "-."),
  "smile": ("tab:red", "D", ":"),
  "smile_nodedup": ("tab:red", "o", "--"),
  "node_limited": ("tab:purple", "v", "-"),
  "node_limited_nodedup": ("tab:purple", "^", "--"),
  "chunked": ("tab:brown", "P", "--"),
  "comet": ("tab:pink", "X", "-."),
  "esp_baseline": ("tab:gray", "<", ":"),
  "s1": ("tab:olive", ">", "-"),
  "s2": ("tab:cyan", "h", "--"),
}
COLOURS = (
  "tab:blue",
  "tab:orange",
  "tab:green",
  "tab:red",
  "tab:purple",
  "tab:brown",
  "tab:pink",
  "tab:gray",
  "tab:olive",
  "tab:cyan",
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "*")
LINESTYLES = ("-", "--", "-.", ":")
# Row fields as axis labels: what the number is, then its unit.
FIELD_LABELS = {
  "samples_per_s": "training throughput (samples/s)",
  "step_s": "training step (s)",
  "layer_ms": "MoE layer forward (ms)",
  "layer_inter_node_ms": "inter-node all-to-all per layer (ms)",
  "layer_intra_node_ms": "intra-node all-to-all per layer (ms)",
  "layer_expert_ms": "expert compute per layer (ms)",
  "layer_other_ms": "other per layer (ms)",
  "layer_hidden_ms": "hidden by overlap per layer (ms)",
  "grad_sync_ms": "gradient sync per step (ms)",
  "tensor_parallel_ms": "tensor-parallel traffic per step (ms)",
  "inter_node_mb_per_gpu": "inter-node traffic per GPU (MB)",
  "intra_node_mb_per_gpu": "intra-node traffic per GPU (MB)",
  "dispatch_bytes_per_row": "a row to the experts (bytes)",
  "combine_bytes_per_row": "a row back (bytes)",
  "comm_hidden_fraction": "share of communication hidden (fraction)",
  "expert_load_imbalance": "busiest expert load / mean (ratio)",
  "sim_dropped_fraction": "dropped tokens (fraction)",
  "layer_ms_min": "MoE layer forward, fastest repeat (ms)",
  "step_s_min": "training step, fastest repeat (s)",
}


def scheme_label(scheme: str) -> str:
  """A scheme as its legend entry: its name, and for '<scheme>_nodedup' what differs from <scheme>."""
  base = scheme.removesuffix(NODEDUP)
  return f"{scheme} ({base}, a row per choice)" if base != scheme else scheme


def dedup_note(schemes) -> str:
  """A line for a title whose plot has schemes without dedup: what dedup means; '' without such schemes."""
  if not any(s.endswith(NODEDUP) for s in schemes):
    return ""
  return f"\ndedup: a token sent once per destination of each hop; '*{NODEDUP}': a row per token-choice"


def accumulation_note(rows: list[dict]) -> str:
  """How many micro batches a step (one gradient sync each) of one panel's modelled rows accumulates, e.g. '4, 2, 1
  micro batches a step at 1, 2, 4 nodes': strong scaling's steps at few nodes accumulate, weak scaling's do not.
  '' where the rows do not say."""
  steps = sorted({(r["nodes"], r["accumulation"]) for r in rows if r["label"] != "measured" and "accumulation" in r})
  counts = [a for _, a in steps]
  if not counts:
    return ""
  if len(set(counts)) == 1:
    return f"{counts[0]} micro batch{'es' if counts[0] > 1 else ''} a step"
  return f"{', '.join(map(str, counts))} micro batches a step at {', '.join(str(n) for n, _ in steps)} nodes"


def field_label(field: str) -> str:
  """A row field as an axis label, 'what (unit)': FIELD_LABELS, else the name with spaces."""
  return FIELD_LABELS.get(field, field.replace("_", " "))


def scheme_styles(schemes) -> dict[str, tuple[str, str, str]]:
  """(colour, marker, linestyle) per scheme: SCHEME_STYLES, and for schemes it lacks the first (colour, marker)
  pairs no other scheme of `schemes` has."""
  styles = {s: SCHEME_STYLES[s] for s in schemes if s in SCHEME_STYLES}
  used = {style[:2] for style in styles.values()}
  spare = (
    (c, m, LINESTYLES[(i + j) % len(LINESTYLES)])
    for j, m in enumerate(MARKERS)
    for i, c in enumerate(COLOURS)
    if (c, m) not in used
  )
  for scheme in schemes:
    if scheme not in styles:
      styles[scheme] = next(spare)
  return styles


def nested_marker(rank: int) -> dict:
  """Line2D keywords of the rank-th curve of a panel: hollow markers, smaller for later curves (so coinciding
  points nest), drawn above the earlier ones."""
  return dict(
    markersize=max(4.0, 12.0 - 1.8 * rank), markerfacecolor="none", markeredgewidth=1.6, linewidth=1.4, zorder=2 + rank
  )


def dodge(rank: int, count: int, spread: float = 0.05) -> float:
  """The factor by which the rank-th of `count` curves' x (nodes, on a log-2 axis) is moved sideways so that
  coinciding points stay apart: 2 ** (spread * (rank - centre)), at most a few percent of a doubling."""
  return 2.0 ** (spread * (rank - (count - 1) / 2))


def node_axis(ax, nodes) -> None:
  """x: nodes on a log-2 axis with a tick at each node count, written as the count (1, 2, 4, not 2^0...)."""
  from matplotlib.ticker import NullLocator

  nodes = sorted(set(nodes))
  ax.set_xscale("log", base=2)
  ax.set_xticks(nodes, [str(n) for n in nodes])
  ax.xaxis.set_minor_locator(NullLocator())
  ax.margins(x=0.08)
  ax.set_xlabel("nodes")


def model_text(config, model: str) -> str:
  """'small: d_model 512, d_ff 2048, 8 layers (4 MoE), 32 x 128 tokens per micro batch' from the sweep's config;
  the name alone without it."""
  shape = config.models[model] if config is not None and model in config.models else None
  if shape is None:
    return f"model {model}"
  text = f"model {model}: d_model {shape['d_model']}, d_ff {shape['d_ff']}, {shape['layers']} layers"
  if "moe_layers" in shape:
    text += f" ({shape['moe_layers']} MoE)"
  if "micro_batch" in shape and "seq_len" in shape:
    text += f", micro batch {shape['micro_batch']} x {shape['seq_len']} tokens"
  return text


def _where(rows: list[dict]) -> tuple[str, str]:
  """('topology p4d_efa', ' and measured on cpu' or '') of rows: the topology the modelled rows are priced on
  and the devices of the measured ones."""
  topologies = sorted({r.get("topology") or "?" for r in rows if r["label"] != "measured"})
  devices = sorted({str(r.get("device")) for r in rows if r["label"] == "measured"})
  return ("topology " + ", ".join(topologies)), (f"; measured on {', '.join(devices)}" if devices else "")


def _grid(count: int, width: float = 5.5, height: float = 4.2):
  """A figure with `count` panels of `width` x `height` inches, three per line (constrained layout, so that
  titles and legends fit)."""
  from matplotlib.figure import Figure

  cols = min(count, 3)
  rows = -(-count // cols)
  fig = Figure(figsize=(width * cols, height * rows + 0.8), layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax in axes.flat[count:]:
    ax.set_visible(False)
  return fig, axes.flat


def _save(fig, path: str) -> None:
  fig.savefig(path, dpi=120)


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


def _scheme_order(scheme: str) -> tuple:
  """Schemes in SCHEME_STYLES's order, others after them by name."""
  order = list(SCHEME_STYLES)
  return (order.index(scheme), "") if scheme in order else (len(order), scheme)


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
      heights = [max(r[field], 0.0) for r in bars]  # a measured remainder is negative when phases add up to more
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


# measured.png: the measured points beside the modelled ones of the same points, with the model's error at each.
MEASURED_PANELS = (("layer_ms", "layer_error", "MoE layer forward (ms)"), ("step_s", "step_error", "training step (s)"))


def _value_axis(ax, values) -> None:
  """y from zero, or logarithmic where the values span more than 20x (an uncalibrated model against a CPU)."""
  positive = [v for v in values if v > 0]
  if positive and max(positive) / min(positive) > 20:
    ax.set_yscale("log")
  else:
    ax.set_ylim(bottom=0, top=1.15 * max(positive, default=1.0))


def measured_figure(rows: list[dict], config=None):
  """The measured rows beside their modelled points: per (model, GPUs per node), one panel of the layer forward and
  one of the training step per scaling, against nodes. Per scheme in its SCHEME_STYLES colour: modelled points
  hollow on a line, extrapolated ones (beyond a calibration's timed meshes) hollow on a dotted line, measured points
  filled, each labelled with the model's error there (modelled / measured - 1: `report.with_model_error`'s
  layer_error and step_error). Returns the matplotlib Figure."""
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
    values = []
    for scheme in sorted({r["scheme"] for r in mine if r["label"] == "measured"}, key=_scheme_order):
      colour, marker, _ = styles[scheme]
      points = {
        label: sorted(
          (r["nodes"], r[field], r.get(error)) for r in mine if r["scheme"] == scheme and r["label"] == label
        )
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
      for n, t, e in points["measured"]:
        if e is not None:
          ax.annotate(f"{e:+.0%}", (n, t), textcoords="offset points", xytext=(6, 4), fontsize=8, color=colour)
      values += [p[1] for p in line] + list(timed)
    node_axis(ax, [r["nodes"] for r in mine])
    _value_axis(ax, values)
    ax.set_ylabel(name)
    title = f"{model}, {m} GPUs/node" + (f", {scaling} scaling" if scaling else "")
    ax.set_title(title + "\nlabels: the model's error at each measured point", fontsize=9)
    ax.legend(fontsize=7)
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
