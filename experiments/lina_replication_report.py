"""experiments.lina_replication's comparison of the replication policies: rows per policy, the estimator's
accuracy, the printed table and the plot."""

import numpy as np

from moejax.replication import estimator
from moejax.replication import rebalance as rebalance_lib

PAPER = {"median": 1.45, "p95": 1.63}  # Lina Sec. 1 (averages of Fig. 16)


def summarize(records, times, overheads):
  """Rows per policy: busiest/mean load, per-layer and per-batch time percentiles, speedups."""
  batches = max(r["batch"] for r in records) + 1
  out = []
  names = [*estimator.POLICIES, "lina_phase2+overheads"]
  base = times["no_replication"]
  for name in names:
    t = times["lina_phase2"] + overheads if name.endswith("overheads") else times[name]
    policy = name.split("+")[0]
    ratio = np.asarray([rebalance_lib.max_load_ratio(r["true"], r["tables"][policy]) for r in records])
    per_batch = np.bincount([r["batch"] for r in records], weights=t, minlength=batches)
    base_batch = np.bincount([r["batch"] for r in records], weights=base, minlength=batches)
    out.append(
      dict(
        policy=name,
        busiest_over_mean=float(ratio.mean()),
        busiest_over_mean_p95=float(np.quantile(ratio, 0.95)),
        layer_p50_ms=1e3 * float(np.median(t)),
        layer_p95_ms=1e3 * float(np.quantile(t, 0.95)),
        speedup_layer_p50=float(np.median(base) / np.median(t)),
        speedup_layer_p95=float(np.quantile(base, 0.95) / np.quantile(t, 0.95)),
        speedup_batch_p50=float(np.median(base_batch) / np.median(per_batch)),
        speedup_batch_p95=float(np.quantile(base_batch, 0.95) / np.quantile(per_batch, 0.95)),
      )
    )
  return out


def plot(rows, times, path):
  """Left: busiest/mean load per policy; right: CDF of the modelled layer times per policy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  rows = [r for r in rows if r["policy"] in estimator.POLICIES]  # the overheads leave the loads alone
  left.bar([r["policy"].replace("_", "\n") for r in rows], [r["busiest_over_mean"] for r in rows])
  left.axhline(1.0, color="gray", lw=0.8)
  left.set_ylabel("busiest / mean device load (mean)")
  left.tick_params(axis="x", labelsize=7)
  for name, t in times.items():
    right.plot(np.sort(t) * 1e3, np.linspace(0, 1, t.size), label=name)
  right.set_xscale("log")
  right.set_xlabel("modelled MoE layer time (ms)")
  right.set_ylabel("CDF over batches x layers")
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def estimation_stats(records) -> dict:
  """Over the planned (batch, layer) records: how often Lina's and the moving average's top-2k sets agree with the
  truth, how often phase 2 re-planned, and the mean L1 distance of each estimate's popularity shares."""
  return dict(
    accuracy=float(np.mean([r["accurate"] for r in records])),
    accuracy_moving_average=float(np.mean([r["accurate_moving_average"] for r in records])),
    replanned=float(np.mean([r["replanned"] for r in records])),
    l1={k: float(np.mean([r[f"l1_{k}"] for r in records])) for k in ("lina", "moving_average")},
  )


def per_layer_accuracy(records) -> dict:
  """Layer (as a string) -> the fraction of its records whose estimate's top-2k set agrees with the truth."""
  return {
    str(layer): float(np.mean([r["accurate"] for r in records if r["layer"] == layer]))
    for layer in sorted({r["layer"] for r in records})
  }


def print_report(stats: dict, rows, choices: int) -> None:
  """The estimator's accuracy and L1 distances against Lina's, then the policies' table (`summarize`'s rows)
  against Lina's speedups; `choices`: the traces' K."""
  l1 = stats["l1"]
  print(
    f"\nestimation accuracy (top-{2 * choices} sets agree; Lina Fig. 19: 58.41% / 54.16%, Table 5 l=3: "
    f"60.4% / 63.5%): Lina {stats['accuracy']:.1%}, moving average {stats['accuracy_moving_average']:.1%}; "
    f"phase-2 re-plans: {stats['replanned']:.1%} (Lina Sec. 7.3.1: 23%)"
  )
  print(f"L1 distance of popularity shares: Lina {l1['lina']:.3f}, moving average {l1['moving_average']:.3f}")
  print(
    f"\n{'policy':22s} {'busiest/mean':>12s} {'p95':>6s} {'layer p50':>10s} {'p95':>8s} {'x p50':>6s} "
    f"{'x p95':>6s} {'batch x p50':>11s} {'x p95':>6s}"
  )
  for r in rows:
    print(
      f"{r['policy']:22s} {r['busiest_over_mean']:12.3f} {r['busiest_over_mean_p95']:6.3f} "
      f"{r['layer_p50_ms']:8.3f}ms {r['layer_p95_ms']:6.3f}ms {r['speedup_layer_p50']:6.2f} "
      f"{r['speedup_layer_p95']:6.2f} {r['speedup_batch_p50']:11.2f} {r['speedup_batch_p95']:6.2f}"
    )
  print(
    f"(x: speedup over no_replication; Lina reports {PAPER['median']}x median, {PAPER['p95']}x p95 inference "
    "time, Sec. 1 / Fig. 16)"
  )
