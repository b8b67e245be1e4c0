"""Draws a training run's curves from its metrics.jsonl (written by `moejax.train.metrics.MetricWriter`).

  python -m experiments.plot_run --workdir=/tmp/mlm                               # writes /tmp/mlm/curves.png
  python -m experiments.plot_run --config.run=/tmp/mlm --workdir=/tmp/mlm_plots   # writes /tmp/mlm_plots/curves.png

One PNG of six panels, x the step: the loss (total and task, nats), the auxiliary loss (summed over MoE layers),
the busiest expert's load over the mean expert load per MoE layer (1.0 = balanced), the token-choices dropped by
expert capacity and lost to full receive buffers (% of all token-choices, mean over MoE layers), the range
max - min of each MoE layer's balancing bias (with `moe.bias_update_rate` > 0) and the throughput. A panel
without data (no MoE layers, no bias) says so, and the figure's title names it. A missing or empty run workdir
(config.run, default --workdir) or metrics.jsonl is a one-line error.
"""

import os
import sys

import numpy as np

from moejax import cli
from moejax.train import metrics as metrics_lib

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "plot_run.py")

METRICS_FILE = "metrics.jsonl"
DEFAULT_OUT = "curves.png"
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
    raise RunError(f"{path} does not exist (train into {workdir} first: python -m experiments.train "
                   f"--workdir={workdir})")
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
  return [(f"MoE layer {i}", [s for s, v in rows if i < len(v)], [v[i] for _, v in rows if i < len(v)])
          for i in range(layers)]


def _panel(name: str, units: str, ylabel: str, lines, reference=None, missing=None, percent=False) -> dict:
  return dict(name=name, title=f"{name} ({units})", ylabel=ylabel, lines=lines, reference=reference,
              missing=missing, percent=percent)


def panels(records: list[dict]) -> list[dict]:
  """The figure's panels: name, title (the name with units), ylabel, lines [(label, steps, values)], reference
  (a y value drawn dashed, or None), percent (a share in %: drawn from 0) and missing (why the panel has no data,
  or None)."""
  steps = [r["step"] for r in records]
  column = lambda name: [float(r[name]) for r in records]
  percent = lambda name: [100 * float(np.mean(r[name])) if r.get(name) else 0.0 for r in records]
  no_moe = None if any(r.get("expert_load") for r in records) else "no MoE layers in the records"
  no_bias = (None if any(r.get("expert_bias_range") for r in records)
             else "no auxiliary-loss-free balancing (moe.bias_update_rate = 0)")
  mtp = all("mtp_loss" in r for r in records) and records  # DeepSeek-V3's multi-token prediction modules
  total = "total (task + aux + lambda x MTP)" if mtp else "total (task + aux)"
  return [
      _panel("loss", "cross-entropy, nats", "nats",
             [(total, steps, column("loss")), ("task", steps, column("task_loss"))]
             + ([("MTP (mean of the modules)", steps, column("mtp_loss"))] if mtp else [])),
      _panel("auxiliary loss", "summed over MoE layers, unitless", "aux loss", [("aux", steps, column("aux_loss"))]),
      _panel("busiest expert load", "x the mean expert load; 1.0 = balanced", "max / mean",
             _per_layer(records, lambda r: busiest_per_layer(r.get("expert_load", []))), reference=1.0,
             missing=no_moe),
      _panel("drops and overflow", "% of all token-choices, mean over MoE layers", "%",
             [] if no_moe else [("dropped (expert capacity)", steps, percent("drop_rate")),
                                ("overflowed (receive buffers)", steps, percent("overflow_rate"))],
             missing=no_moe, percent=True),
      _panel("expert bias range", "max - min of each layer's bias, score units", "bias range",
             _per_layer(records, lambda r: r.get("expert_bias_range", [])), missing=no_bias),
      _panel("throughput", "tokens/s", "tokens/s", [("tokens/s", steps, column("tokens_per_s"))]),
  ]


def draw(records: list[dict], title: str):
  """The matplotlib Figure of `panels(records)` (Agg backend), titled `title` and the panels without data."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib.ticker import MaxNLocator

  found = panels(records)
  fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
  for ax, panel in zip(axes.flat, found):
    ax.set_title(panel["title"], fontsize=10)
    ax.set_ylabel(panel["ylabel"])
    ax.grid(alpha=0.3)
    if panel["missing"]:
      ax.text(0.5, 0.5, f"no data: {panel['missing']}", ha="center", va="center", transform=ax.transAxes,
              color="gray", wrap=True)
      continue
    for i, (label, xs, ys) in enumerate(panel["lines"]):  # a line style and marker each: equal curves stay visible
      ax.plot(xs, ys, LINE_STYLES[i % len(LINE_STYLES)], marker=MARKERS[i % len(MARKERS)] if len(xs) <= 50 else None,
              label=label)
    if panel["percent"]:
      peak = max((max(ys) for _, _, ys in panel["lines"]), default=0.0)
      ax.set_ylim(0, 1.1 * peak if peak > 0 else 1.0)
      if peak == 0:
        ax.text(0.5, 0.5, "none in any step", ha="center", va="center", transform=ax.transAxes, color="gray")
    if panel["reference"] is not None:
      ax.axhline(panel["reference"], color="gray", linestyle="--", linewidth=1, label="balanced")
    ax.legend(fontsize=7)
  for ax in axes[-1]:
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  steps = [r["step"] for r in records]
  empty = [p["name"] for p in found if p["missing"]]
  heading = f"{title}: {len(records)} steps ({steps[0]} to {steps[-1]})"
  fig.suptitle(heading + ("\nno data: " + ", ".join(empty) if empty else ""), fontsize=11)
  fig.tight_layout()
  return fig


def plot_run(workdir: str, out: str | None = None) -> tuple[str, list[str]]:
  """Writes the curves of the run in `workdir` to `out` (default `workdir`/curves.png); returns the path and the
  names of the panels without data. RunError when there is nothing to draw."""
  records = load_records(workdir)
  out = out or os.path.join(workdir, DEFAULT_OUT)
  if os.path.dirname(out):
    os.makedirs(os.path.dirname(out), exist_ok=True)
  fig = draw(records, os.path.basename(os.path.normpath(workdir)) or workdir)
  fig.savefig(out, dpi=110)
  from matplotlib import pyplot as plt
  plt.close(fig)
  return out, [p["name"] for p in panels(records) if p["missing"]]


def main(argv):
  del argv
  workdir = _WORKDIR.value
  try:
    out, empty = plot_run(_CONFIG.value.run or workdir, os.path.join(workdir, DEFAULT_OUT))
  except RunError as e:
    sys.exit(f"error: {e}")
  print(f"wrote {out}" + (f" (no data: {', '.join(empty)})" if empty else ""))


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/plot_run.py).")
  _WORKDIR = cli.define_workdir(f"Directory for {DEFAULT_OUT} (and the run drawn unless config.run names one).")
  cli.run(main)
