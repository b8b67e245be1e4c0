"""The routers' convergence study's report (experiments/convergence.py): one table row per model x router over the
seeds, the markdown table, and the train loss and busiest-load plots."""

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
    rows.append({"model": key[0], "router": key[1], "seeds": len(runs),
                 "heldout_loss": float(np.mean(heldout)), "heldout_spread": spread(heldout),
                 "train_loss": float(np.mean([np.mean(r["train_loss"][-tail:]) for r in runs])),
                 "busiest_load": float(np.mean([np.mean(r["busiest_load"]) for r in runs])),
                 "drop_share": float(np.mean([np.mean(r["drop_share"]) for r in runs]))})
  return rows


def format_table(rows: list[dict], capacity: float) -> str:
  lines = [f"| model | router | seeds | held-out loss (mean ± std) | final train loss | busiest load / mean | "
           f"dropped at capacity {capacity:g} |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['router']} | {r['seeds']} | {r['heldout_loss']:.4f} ± "
                 f"{r['heldout_spread']:.4f} | {r['train_loss']:.4f} | {r['busiest_load']:.3f} | "
                 f"{100 * r['drop_share']:.2f}% |")
  return "\n".join(lines)


def plot(results: list[dict], workdir: str) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(r["model"] for r in results))
  routers = list(dict.fromkeys(r["router"] for r in results))
  colors = {router: f"C{i}" for i, router in enumerate(routers)}
  paths = []
  for name, field, ylabel in (("loss.png", "train_loss", "train loss (task)"),
                              ("busiest_load.png", "busiest_load", "busiest expert load / mean")):
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
      for router in routers:
        runs = [r for r in results if (r["model"], r["router"]) == (model, router)]
        if not runs:
          continue
        n = min(len(r[field]) for r in runs)
        curve = np.mean([r[field][:n] for r in runs], axis=0)
        window = max(1, n // 20)  # a light moving average over the noisy per-step values
        smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
        label = router
        if field == "train_loss":
          label += f" (held-out {np.mean([r['heldout_loss'] for r in runs]):.3f})"
        ax.plot(runs[0]["steps"][window - 1:n], smooth, color=colors[router], label=label)
      ax.set_title(f"{model}-MoE")
      ax.set_xlabel("step")
      ax.set_ylabel(ylabel)
      ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(workdir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
