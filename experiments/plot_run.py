"""Draws training runs' curves from their metrics.jsonl (written by `moejax.train.metrics.MetricWriter`), several
runs overlaid, and says which config fields differ between them.

  python -m experiments.plot_run --workdir=/tmp/mlm                               # writes /tmp/mlm/curves.png
  python -m experiments.plot_run /tmp/mlm                                         # the same (as the trainer prints)
  python -m experiments.plot_run --config.runs=/tmp/mlm --workdir=/tmp/mlm_plots  # writes /tmp/mlm_plots/curves.png
  python -m experiments.plot_run --config.runs=/tmp/a,/tmp/b --workdir=/tmp/a_vs_b  # two runs, one colour each

One PNG of six panels, x the step: the loss (total and task, nats; the held-out loss where the run evaluated it,
with the held-out tokens' unigram entropy dashed: the baseline a model must beat), the auxiliary loss (summed over
MoE layers), the busiest expert's load over the mean expert load per MoE layer (1.0 = balanced), the token-choices
dropped by expert capacity and lost to full receive buffers (% of all token-choices, mean over MoE layers), the range
max - min of each MoE layer's balancing bias (with `moe.bias_update_rate` > 0) and the throughput. A panel
without data (no MoE layers, no bias) says so, and the figure's title names it. With several runs, the title and
the printed output name the config fields that differ between them, read from each workdir's config.json (the
run's resolved config, `moejax.run_config`, and the versions it ran with, `moejax.train.resume`); a workdir without
one is compared by what its metrics.jsonl shows (MoE layers, experts, tokens per step, peak learning rate), and the
output says so. A missing or empty run workdir (config.runs, default --workdir) or metrics.jsonl is a one-line error.
curves.png goes into a drawn run's workdir, or into one of plot_run's own (`moejax.workdir_guard`): a workdir holding
another program's outputs (a sweep, an export, another run) is refused.
"""

import os
import sys

import numpy as np

from experiments.plot_run_compare import compare, difference_lines, run_names
from moejax import cli, workdir_guard
from moejax.train import metrics as metrics_lib

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "plot_run.py")

METRICS_FILE = "metrics.jsonl"
DEFAULT_OUT = "curves.png"
PROGRAM = "experiments.plot_run"
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = (".", "x", "+", "1")


class RunError(Exception):
  """A workdir without records to draw."""


def load_records(workdir: str) -> list[dict]:
  """The records of `workdir`/metrics.jsonl sorted by step; RunError when the directory or file is missing, or
  the file holds no complete record."""
  if not os.path.isdir(workdir):
    raise RunError(f"no such workdir: {workdir}")
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    raise RunError(
      f"{path} does not exist (train into {workdir} first: python -m experiments.train --workdir={workdir})"
    )
  records = [r for r in metrics_lib.read_jsonl(path) if isinstance(r, dict) and "step" in r]
  if not records:
    raise RunError(f"{path} holds no complete step record")
  return sorted(records, key=lambda r: r["step"])


def busiest_per_layer(expert_load: list[list[float]]) -> list[float]:
  """Per MoE layer the busiest expert's load over the mean expert load (nan for a layer without load)."""
  out = []
  for load in expert_load:
    mean = float(np.mean(load)) if len(load) else 0.0
    out.append(max(load) / mean if mean > 0 else float("nan"))
  return out


def _per_layer(records: list[dict], values) -> list[tuple[str, list, list]]:
  """Lines ("MoE layer i", steps, values) from `values(record)` -> a list with one value per MoE layer
  (records without the field give [])."""
  rows = [(r["step"], values(r)) for r in records]
  layers = max((len(v) for _, v in rows), default=0)
  return [
    (f"MoE layer {i}", [s for s, v in rows if i < len(v)], [v[i] for _, v in rows if i < len(v)]) for i in range(layers)
  ]


def _panel(name: str, units: str, ylabel: str, lines, reference=None, missing=None, percent=False) -> dict:
  return dict(
    name=name,
    title=f"{name} ({units})",
    ylabel=ylabel,
    lines=lines,
    reference=reference,
    missing=missing,
    percent=percent,
  )


def panels(records: list[dict]) -> list[dict]:
  """The figure's panels: name, title (the name with units), ylabel, lines [(label, steps, values)], reference
  ((y value, label) drawn dashed, or None), percent (a share in %: drawn from 0) and missing (why the panel has no
  data, or None)."""
  steps = [r["step"] for r in records]
  column = lambda name: [float(r[name]) for r in records]
  percent = lambda name: [100 * float(np.mean(r[name])) if r.get(name) else 0.0 for r in records]
  no_moe = None if any(r.get("expert_load") for r in records) else "no MoE layers in the records"
  no_bias = (
    None
    if any(r.get("expert_bias_range") for r in records)
    else "no auxiliary-loss-free balancing (moe.bias_update_rate = 0)"
  )
  mtp = all("mtp_loss" in r for r in records) and records  # DeepSeek-V3's multi-token prediction modules
  total = "total (task + aux + lambda x MTP)" if mtp else "total (task + aux)"
  evaluated = [r for r in records if "heldout_loss" in r]  # log.eval_every's steps
  heldout = [("held-out", [r["step"] for r in evaluated], [r["heldout_loss"] for r in evaluated])] if evaluated else []
  baseline = evaluated[-1].get("heldout_unigram_entropy") if evaluated else None
  return [
    _panel(
      "loss",
      "cross-entropy, nats",
      "nats",
      [(total, steps, column("loss")), ("task", steps, column("task_loss"))]
      + ([("MTP (mean of the modules)", steps, column("mtp_loss"))] if mtp else [])
      + heldout,
      reference=None if baseline is None else (baseline, "unigram entropy of the held-out tokens"),
    ),
    _panel("auxiliary loss", "summed over MoE layers, unitless", "aux loss", [("aux", steps, column("aux_loss"))]),
    _panel(
      "busiest expert load",
      "x the mean expert load; 1.0 = balanced",
      "max / mean",
      _per_layer(records, lambda r: busiest_per_layer(r.get("expert_load", []))),
      reference=(1.0, "balanced"),
      missing=no_moe,
    ),
    _panel(
      "drops and overflow",
      "% of all token-choices, mean over MoE layers",
      "%",
      []
      if no_moe
      else [
        ("dropped (expert capacity)", steps, percent("drop_rate")),
        ("overflowed (receive buffers)", steps, percent("overflow_rate")),
      ],
      missing=no_moe,
      percent=True,
    ),
    _panel(
      "expert bias range",
      "max - min of each layer's bias, score units",
      "bias range",
      _per_layer(records, lambda r: r.get("expert_bias_range", [])),
      missing=no_bias,
    ),
    _panel("throughput", "tokens/s", "tokens/s", [("tokens/s", steps, column("tokens_per_s"))]),
  ]


def _no_data(ax, missing: str) -> None:
  """The panel's reason for having no data, in gray across its axes."""
  ax.text(
    0.5,
    0.5,
    f"no data: {missing}",
    ha="center",
    va="center",
    transform=ax.transAxes,
    color="gray",
    wrap=True,
  )


def _plot_lines(ax, mine: dict[str, dict], several: bool) -> float:
  """Every run's lines of one panel ({run: panel}) on ax; returns the highest value drawn (0.0 for none)."""
  peak = 0.0
  for r, (name, pn) in enumerate(mine.items()):
    for i, (label, xs, ys) in enumerate(pn["lines"]):
      # A line style each, and a marker each (of the line, or of the run where there are several): equal curves
      # stay visible.
      marker = MARKERS[(r if several else i) % len(MARKERS)] if len(xs) <= 50 else None
      ax.plot(
        xs,
        ys,
        LINE_STYLES[i % len(LINE_STYLES)],
        marker=marker,
        color=f"C{r}" if several else None,
        label=f"{name}: {label}" if several else label,
      )
      peak = max([peak, *ys])
  return peak


def _finish_axes(ax, panel: dict, peak: float) -> None:
  """A share drawn from 0 ('none in any step' where nothing was), the panel's reference dashed, the legend."""
  if panel["percent"]:
    ax.set_ylim(0, 1.1 * peak if peak > 0 else 1.0)
    if peak == 0:
      ax.text(0.5, 0.5, "none in any step", ha="center", va="center", transform=ax.transAxes, color="gray")
  if panel["reference"] is not None:
    ax.axhline(panel["reference"][0], color="gray", linestyle="--", linewidth=1, label=panel["reference"][1])
  ax.legend(fontsize=7)


def _draw_panel(ax, mine: dict[str, dict]) -> str | None:
  """One panel of every run ({run: panel}) on ax; returns its entry in the title's 'no data' list (the panel's name,
  with several runs and not all of them without data, the runs without), or None where every run has data."""
  several = len(mine) > 1
  panel = next(iter(mine.values()))
  ax.set_title(panel["title"], fontsize=10)
  ax.set_ylabel(panel["ylabel"])
  ax.grid(alpha=0.3)
  without = [name for name, pn in mine.items() if pn["missing"]]
  empty = None
  if without:
    empty = panel["name"] + (f" (in {', '.join(without)})" if several and len(without) < len(mine) else "")
  if len(without) == len(mine):
    _no_data(ax, panel["missing"])
    return empty
  _finish_axes(ax, panel, _plot_lines(ax, mine, several))
  return empty


def draw(runs: dict[str, list[dict]], notes: list[str] = ()):
  """The matplotlib Figure (Agg backend) of `panels` of every run in `runs` ({name: records}) overlaid (a colour
  per run where there are several), titled with each run's steps, `notes` and the panels without data."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib.ticker import MaxNLocator

  found = {name: panels(records) for name, records in runs.items()}
  fig, axes = plt.subplots(3, 2, figsize=(13, 11 + 0.2 * len(notes)), sharex=True)
  drawn = (
    _draw_panel(ax, {name: panel_list[p] for name, panel_list in found.items()}) for p, ax in enumerate(axes.flat)
  )
  empty = [entry for entry in drawn if entry is not None]
  for ax in axes[-1]:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  heading = "; ".join(f"{name}: {len(rs)} steps ({rs[0]['step']} to {rs[-1]['step']})" for name, rs in runs.items())
  fig.suptitle("\n".join([heading, *notes] + (["no data: " + ", ".join(empty)] if empty else [])), fontsize=11)
  fig.tight_layout()
  return fig


# At most this many differing fields in the figure's title (all of them are printed).
TITLE_FIELDS = 6


def plot_run(workdirs: list[str], out: str) -> tuple[list[str], list[str]]:
  """Writes the curves of the runs in `workdirs` to `out`; returns the names of the panels without data and, with
  several runs, the lines saying which config fields differ. RunError when a run has nothing to draw."""
  names = run_names(workdirs)
  records = {name: load_records(workdir) for name, workdir in zip(names, workdirs)}
  lines = difference_lines(*compare(dict(zip(names, workdirs)), records)) if len(workdirs) > 1 else []
  notes = lines[: TITLE_FIELDS + 1] + (
    [f"  ... and {len(lines) - TITLE_FIELDS - 1} more"] if len(lines) > TITLE_FIELDS + 1 else []
  )
  if os.path.dirname(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
  fig = draw(records, notes)
  fig.savefig(out, dpi=110)
  from matplotlib import pyplot as plt

  plt.close(fig)
  return [p["name"] for p in panels(next(iter(records.values()))) if p["missing"]], lines


def main(argv):
  workdir = workdir_guard.workdir_argument(argv, _WORKDIR.value, PROGRAM)
  runs = list(_CONFIG.value.runs) or [workdir]
  # curves.png goes beside a drawn run's files, else into a workdir of plots that no other program owns.
  workdir_guard.check(workdir, PROGRAM, beside=runs)
  out = os.path.join(workdir, DEFAULT_OUT)
  try:
    empty, lines = plot_run(runs, out)
  except RunError as e:
    sys.exit(f"error: {e}")
  workdir_guard.claim(workdir, PROGRAM, beside=runs)
  print(f"wrote {out}" + (f" (no data: {', '.join(empty)})" if empty else ""))
  for line in lines:
    print(line)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/plot_run.py).")
  _WORKDIR = cli.define_workdir(f"Directory for {DEFAULT_OUT} (or the argument WORKDIR).", required=False)
  cli.run(main)
