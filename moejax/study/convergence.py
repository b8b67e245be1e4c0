"""The routers' convergence study's report (experiments/convergence.py): one table row per model x router over the
seeds, the markdown table, and the train loss and busiest-load plots; `redraw` makes them from a study's
results.json without training (experiments/convergence_report.py).
"""

import json
import os

import numpy as np


def spread(values: list[float]) -> float:
  return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def table_rows(results: list[dict], tail: int) -> list[dict]:
  """One row per model x router: final held-out loss (mean, sample std over seeds), final train loss (mean
  of the last `tail` steps), busiest load and drop share (means over all steps and seeds)."""
  rows = []
  for key in dict.fromkeys((r["model"], r["router"]) for r in results):
    runs = [r for r in results if (r["model"], r["router"]) == key]
    heldout = [r["heldout_loss"] for r in runs]
    rows.append(
      {
        "model": key[0],
        "router": key[1],
        "seeds": len(runs),
        "heldout_loss": float(np.mean(heldout)),
        "heldout_spread": spread(heldout),
        "train_loss": float(np.mean([np.mean(r["train_loss"][-tail:]) for r in runs])),
        "busiest_load": float(np.mean([np.mean(r["busiest_load"]) for r in runs])),
        "drop_share": float(np.mean([np.mean(r["drop_share"]) for r in runs])),
      }
    )
  return rows


def format_table(rows: list[dict], capacity: float) -> str:
  lines = [
    f"| model | router | seeds | held-out loss (mean ± std) | final train loss | busiest load / mean | "
    f"dropped at capacity {capacity:g} |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['model']} | {r['router']} | {r['seeds']} | {r['heldout_loss']:.4f} ± "
      f"{r['heldout_spread']:.4f} | {r['train_loss']:.4f} | {r['busiest_load']:.3f} | "
      f"{100 * r['drop_share']:.2f}% |"
    )
  return "\n".join(lines)


# One style per router, (colour, marker, linestyle); switch, smile and node_limited as in the sweep's plots
# (moejax.study.plots.SCHEME_STYLES). Routers it lacks get the remaining colours and markers in turn.
ROUTER_STYLES = {
  "switch": ("tab:blue", "o", "-"),
  "gshard": ("tab:green", "^", "-."),
  "smile": ("tab:red", "D", ":"),
  "node_limited": ("tab:purple", "v", "-"),
  "deepseek_v3": ("tab:brown", "P", "--"),
}
_SPARE = (
  ("tab:orange", "s", "--"),
  ("tab:pink", "X", "-."),
  ("tab:gray", "<", ":"),
  ("tab:olive", ">", "-"),
  ("tab:cyan", "h", "--"),
)
FIELDS = (
  ("loss.png", "train_loss", "train loss (task, nats/token)"),
  ("busiest_load.png", "busiest_load", "busiest expert load / mean"),
)


def router_styles(routers) -> dict[str, tuple[str, str, str]]:
  """(colour, marker, linestyle) per router: ROUTER_STYLES, then unused spares for routers it lacks."""
  styles = {r: ROUTER_STYLES[r] for r in routers if r in ROUTER_STYLES}
  spare = iter(s for s in _SPARE if s[:2] not in {v[:2] for v in styles.values()})
  return {r: styles.get(r) or next(spare) for r in routers}


def smoothed(runs: list[dict], field: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps [n - w + 1], per-seed moving averages [seeds, n - w + 1]) of runs' `field` over their common first
  n steps, w = max(1, n // 20) steps a window (the per-step values are noisy)."""
  n = min(len(r[field]) for r in runs)
  window = max(1, n // 20)
  kernel = np.ones(window) / window
  curves = np.stack([np.convolve(np.asarray(r[field][:n], float), kernel, mode="valid") for r in runs])
  return np.asarray(runs[0]["steps"][window - 1 : n]), curves


def _caption(results: list[dict], mesh=None) -> str:
  seeds = sorted({r.get("seed") for r in results}, key=str)
  where = f" on a {' x '.join(map(str, mesh))} CPU mesh" if mesh else ""
  return (
    f"measured in training runs{where}: mean over {len(seeds)} seed(s), moving average over "
    f"{max(1, min(len(r['steps']) for r in results) // 20)} steps"
  )


def loss_figure(results: list[dict], baseline: str | None = None, mesh=None):
  """Train loss per router: top row the curves (one panel per model, mean over seeds), bottom row each router's
  curve minus the baseline router's (default the first router), with the band of the baseline's seeds (mean
  +- sample std), so that differences smaller than the curves' overlap read against the seeds' noise.
  Returns the matplotlib Figure."""
  from matplotlib.figure import Figure

  models = list(dict.fromkeys(r["model"] for r in results))
  routers = list(dict.fromkeys(r["router"] for r in results))
  baseline = baseline or routers[0]
  styles = router_styles(routers)
  fig = Figure(figsize=(6.5 * len(models), 8), layout="constrained")
  axes = fig.subplots(2, len(models), squeeze=False, sharex="col")
  for col, model in enumerate(models):
    top, bottom = axes[0, col], axes[1, col]
    base = [r for r in results if (r["model"], r["router"]) == (model, baseline)]
    steps, base_curves = smoothed(base, "train_loss")
    base_mean = base_curves.mean(0)
    spread = base_curves.std(0, ddof=1) if len(base) > 1 else np.zeros_like(base_mean)
    bottom.fill_between(steps, -spread, spread, color="0.85", label=f"{baseline}'s seeds (+- 1 std)")
    bottom.axhline(0.0, color="0.4", linewidth=0.8)
    for rank, router in enumerate(routers):
      runs = [r for r in results if (r["model"], r["router"]) == (model, router)]
      if not runs:
        continue
      colour, marker, linestyle = styles[router]
      steps_r, curves = smoothed(runs, "train_loss")
      line = dict(
        color=colour,
        marker=marker,
        linestyle=linestyle,
        markevery=(rank * 3, max(1, len(steps_r) // 8)),
        markerfacecolor="none",
        markersize=7,
        linewidth=1.4,
      )
      held = np.mean([r["heldout_loss"] for r in runs])
      top.plot(steps_r, curves.mean(0), label=f"{router} (held-out {held:.3f})", **line)
      if router != baseline:
        n = min(len(steps_r), len(steps))
        bottom.plot(steps_r[:n], curves.mean(0)[:n] - base_mean[:n], label=router, **line)
    top.set_title(f"{model}-MoE: train loss", fontsize=10)
    top.set_ylabel(FIELDS[0][2])
    top.legend(fontsize=8)
    bottom.set_title(f"{model}-MoE: train loss minus {baseline}'s", fontsize=10)
    bottom.set_ylabel(f"train loss - {baseline}'s")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
  fig.suptitle(f"Routers' train loss, {_caption(results, mesh)}", fontsize=10)
  return fig


def load_figure(results: list[dict], baseline: str | None = None, mesh=None):
  """Busiest expert's load / mean: one panel per model (row) and router (column), the router's seeds thin and
  their mean thick, the baseline router's mean dashed grey beside it for reference; panels of a model share
  their y axis. Returns the matplotlib Figure."""
  from matplotlib.figure import Figure

  models = list(dict.fromkeys(r["model"] for r in results))
  routers = list(dict.fromkeys(r["router"] for r in results))
  baseline = baseline or routers[0]
  styles = router_styles(routers)
  fig = Figure(figsize=(3.4 * len(routers), 3.2 * len(models) + 0.6), layout="constrained")
  axes = fig.subplots(len(models), len(routers), squeeze=False, sharey="row", sharex=True)
  for row, model in enumerate(models):
    base = [r for r in results if (r["model"], r["router"]) == (model, baseline)]
    base_steps, base_curves = smoothed(base, "busiest_load") if base else (None, None)
    for col, router in enumerate(routers):
      ax = axes[row, col]
      runs = [r for r in results if (r["model"], r["router"]) == (model, router)]
      if not runs:
        ax.set_visible(False)
        continue
      colour, marker, linestyle = styles[router]
      steps, curves = smoothed(runs, "busiest_load")
      for seed_curve in curves:
        ax.plot(steps, seed_curve, color=colour, linewidth=0.6, alpha=0.35)
      ax.plot(
        steps,
        curves.mean(0),
        color=colour,
        marker=marker,
        linestyle=linestyle,
        linewidth=1.8,
        markevery=max(1, len(steps) // 8),
        markerfacecolor="none",
        markersize=7,
        label=router,
      )
      if router != baseline and base_curves is not None:
        ax.plot(base_steps, base_curves.mean(0), color="0.5", linestyle="--", linewidth=1.0, label=baseline)
      ax.axhline(1.0, color="0.8", linewidth=0.8)
      ax.set_title(f"{model}-MoE, {router}", fontsize=10)
      ax.legend(fontsize=7, loc="upper right")
      if col == 0:
        ax.set_ylabel(FIELDS[1][2])
      if row == len(models) - 1:
        ax.set_xlabel("step")
  fig.suptitle(
    f"Busiest expert's load / mean per router ({_caption(results, mesh)}; thin: each seed; 1 = balanced)", fontsize=10
  )
  return fig


def plot(results: list[dict], workdir: str, mesh=None) -> list[str]:
  """loss.png (`loss_figure`) and busiest_load.png (`load_figure`) in workdir; returns their paths."""
  paths = []
  for (name, _, _), make in zip(FIELDS, (loss_figure, load_figure)):
    path = os.path.join(workdir, name)
    make(results, mesh=mesh).savefig(path, dpi=100)
    paths.append(path)
  return paths


def redraw(results_path: str, workdir: str) -> list[str]:
  """table.md, loss.png and busiest_load.png in workdir from a study's results.json (the committed
  benchmarks/results/2026-11-23-cpu/convergence.json draws docs/convergence/) without training anything."""
  with open(results_path) as f:
    record = json.load(f)
  config = record["config"]
  os.makedirs(workdir, exist_ok=True)
  table = format_table(table_rows(record["runs"], tail=max(1, config["steps"] // 10)), config["capacity"])
  path = os.path.join(workdir, "table.md")
  with open(path, "w") as f:
    f.write(table + "\n")
  return [path, *plot(record["runs"], workdir, mesh=record.get("mesh"))]
