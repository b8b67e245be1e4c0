"""Overlays the scaling curves of several sweep workdirs (moejax.study.sweep) in one plot and one table.

  python -m experiments.compare_sweeps --workdirs /tmp/sweep_h100,/tmp/sweep_p4d --out /tmp/compare.png
  python -m experiments.compare_sweeps --workdirs a,b --labels "DGX H100,P4d EFA" --metric layer_ms

Each workdir's results.json ({"config", "rows"}, written by `moejax.study.report.write_all`) is read, or its
results.csv when there is no JSON. A curve is one (workdir, model, scaling, scheme, GPUs per node, modelled or
measured) over nodes, labelled by its config: the workdir's label (--labels, default its directory name), the
topology, model, scheme, mesh width, scaling and whether it is modelled or measured, so that runs on two
topologies, two models, or modelled against measured read apart. Prints one line per curve (the metric at every
node count any curve has) and writes one PNG: x nodes (log 2), y the metric (log).
"""

import csv
import json
import os

from absl import app, flags

CURVE_KEY = ("model", "scaling", "scheme", "gpus_per_node", "label")
NUMERIC = ("nodes", "gpus_per_node", "samples_per_s", "layer_ms", "step_s")


def load_rows(workdir: str) -> tuple[list[dict], dict]:
  """(rows, config) of a sweep workdir: results.json, else results.csv (config {} then)."""
  path = os.path.join(workdir, "results.json")
  if os.path.exists(path):
    with open(path) as f:
      record = json.load(f)
    return record["rows"], record.get("config", {})
  path = os.path.join(workdir, "results.csv")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} has neither results.json nor results.csv (run the sweep first)")
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for field in NUMERIC:
      if row.get(field) not in (None, ""):
        row[field] = float(row[field]) if field not in ("nodes", "gpus_per_node") else int(float(row[field]))
  return rows, {}


def curves(workdirs, labels=None, metric: str = "samples_per_s") -> list[dict]:
  """One dict per curve: label, workdir, its config fields and points [(nodes, metric)] sorted by nodes."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f"{len(labels)} labels for {len(workdirs)} workdirs")
  out = []
  for workdir, name in zip(workdirs, labels):
    rows, _ = load_rows(workdir)
    groups = {}
    for row in rows:
      if row.get(metric) in (None, ""):
        continue
      groups.setdefault(tuple(row[k] for k in CURVE_KEY), []).append(row)
    for key, members in groups.items():
      fields = dict(zip(CURVE_KEY, key))
      topology = members[0].get("topology") or ""
      where = f"on {members[0].get('device')}" if fields["label"] == "measured" else f"on {topology}"
      out.append(dict(fields, kind=fields["label"], workdir=workdir, name=name, topology=topology,
                      label=f"{name}: {fields['model']} {fields['scheme']} x{fields['gpus_per_node']} GPUs/node, "
                            f"{fields['scaling']}, {fields['label']} {where}",
                      points=sorted((int(r["nodes"]), float(r[metric])) for r in members)))
  return out


def format_table(found: list[dict], metric: str) -> str:
  nodes = sorted({n for c in found for n, _ in c["points"]})
  width = max([len(c["label"]) for c in found] + [5])
  lines = [f"{metric} against nodes", f"{'curve':{width}s}" + "".join(f" {n:>10d}" for n in nodes)]
  for c in found:
    by_node = dict(c["points"])
    lines.append(f"{c['label']:{width}s}" + "".join(f" {by_node[n]:10.4g}" if n in by_node else f" {'-':>10s}"
                                                      for n in nodes))
  return "\n".join(lines)


def plot(found: list[dict], metric: str, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 6))
  for c in found:
    nodes, values = zip(*c["points"])
    ax.plot(nodes, values, "o-" if c["kind"] == "modelled" else "x--", label=c["label"])
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("nodes")
  ax.set_ylabel(f"{metric} (solid: modelled, dashed: measured)")
  ax.set_title("scaling curves of " + ", ".join(dict.fromkeys(c["name"] for c in found)))
  ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a program (tests import the functions beside other
  experiments that define flags of the same names)."""
  flags.DEFINE_list("workdirs", None, "Sweep workdirs (each with results.json or results.csv).", required=True)
  flags.DEFINE_list("labels", None, "One label per workdir (default: the directory names).")
  flags.DEFINE_string("metric", "samples_per_s", "Row field to draw: samples_per_s, layer_ms, step_s, ...")
  flags.DEFINE_string("out", "compare_sweeps.png", "Path of the PNG.")


def main(argv):
  del argv
  found = curves(FLAGS.workdirs, FLAGS.labels, FLAGS.metric)
  if not found:
    raise app.UsageError(f"no rows with {FLAGS.metric!r} in {FLAGS.workdirs}")
  print(format_table(found, FLAGS.metric))
  plot(found, FLAGS.metric, FLAGS.out)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
