"""The style every sweep plot shares (`moejax.study.sweep_plots`, `efficiency`, `experiments.compare_sweeps`): one
(colour, marker, linestyle) per scheme, node counts as ticks, labels with units, the titles' notes, and the papers'
published points drawn beside the modelled curves."""

from moejax.study.points import NODEDUP

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
  "layer_control_ms": "control collectives per layer (ms)",
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


def _scheme_order(scheme: str) -> tuple:
  """Schemes in SCHEME_STYLES's order, others after them by name."""
  order = list(SCHEME_STYLES)
  return (order.index(scheme), "") if scheme in order else (len(order), scheme)
