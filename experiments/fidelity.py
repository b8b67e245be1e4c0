"""The fidelity table: every headline figure of the five papers against the cost model, in one place.

  python -m experiments.fidelity --out_dir /tmp/fidelity

Prints one line per paper figure (paper, quantity, paper value, model value, relative error model / paper - 1,
role, source) and writes fidelity.json and fidelity.png (paper against model on log axes, the diagonal and a
+-25% band; filled markers held out, open markers fitted) to --out_dir. The lines come from the per-paper
modules of experiments/validation (`fidelity_rows()` each). Discipline: per testbed at most two parameters are
fitted, each on named entries (role 'fit', which then test nothing); every other entry is 'held out' and its error
is what the table is for. ExFlow's lines are 'not modelled' (see experiments/validation/exflow.py).
"""

import json
import os

from absl import app, flags

from experiments.validation import comet, exflow, lina, parm, smile

PAPERS = {"SMILE": smile.fidelity_rows, "Comet": comet.fidelity_rows, "Parm": parm.fidelity_rows,
          "Lina": lina.fidelity_rows, "ExFlow": exflow.fidelity_rows}
CONSISTENCY = {"SMILE": smile.consistency_text}  # papers whose figures contradict each other, quantified
TOLERANCE = 0.25  # the bar for a held-out headline figure


def collect(papers=None) -> list[dict]:
  """The fidelity rows of `papers` (names of PAPERS; None: all)."""
  return [row for name in (papers or PAPERS) for row in PAPERS[name]()]


def _value(x) -> str:
  return "-" if x is None else f"{x:.4g}"


def format_table(rows: list[dict]) -> str:
  """Aligned text: one line per row, then the count of held-out rows within TOLERANCE."""
  lines = [f"{'paper':6s} {'quantity':58s} {'paper':>9s} {'model':>9s} {'error':>8s}  {'role':12s} {'variant':16s} "
           "source"]
  for r in rows:
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:+.1%}"
    flag = " *" if r["role"] == "held out" and abs(r["rel_err"]) > TOLERANCE else ""
    lines.append(f"{r['paper']:6s} {r['quantity'][:58]:58s} {_value(r['paper_value']):>9s} "
                 f"{_value(r['model_value']):>9s} {err:>8s}{flag:2s}{r['role']:12s} {r['variant'][:16]:16s} "
                 f"{r['source']}")
  held = [r for r in rows if r["role"] == "held out"]
  within = [r for r in held if abs(r["rel_err"]) <= TOLERANCE]
  lines.append(f"held out: {len(within)} of {len(held)} within {TOLERANCE:.0%} (* beyond); "
               f"fit: {sum(r['role'] == 'fit' for r in rows)}; not modelled: "
               f"{sum(r['role'] == 'not modelled' for r in rows)}")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  """Paper against model on log axes, one colour per paper; filled held out, open fit; y = x and +-25%."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  drawn = [r for r in rows if r["model_value"] is not None and r["paper_value"] > 0 and r["model_value"] > 0]
  fig, ax = plt.subplots(figsize=(7, 6.5))
  values = [v for r in drawn for v in (r["paper_value"], r["model_value"])]
  lo, hi = min(values) / 2, max(values) * 2
  ax.plot([lo, hi], [lo, hi], "k-", linewidth=0.8, label="model = paper")
  ax.fill_between([lo, hi], [lo * (1 - TOLERANCE), hi * (1 - TOLERANCE)], [lo * (1 + TOLERANCE), hi * (1 + TOLERANCE)],
                  color="0.9", label=f"within {TOLERANCE:.0%}")
  for paper in dict.fromkeys(r["paper"] for r in drawn):
    color = None
    for role, face in (("held out", "full"), ("fit", "none")):
      mine = [r for r in drawn if r["paper"] == paper and r["role"] == role]
      if mine:
        line = ax.plot([r["paper_value"] for r in mine], [r["model_value"] for r in mine], "o", color=color,
                       fillstyle=face, label=f"{paper} ({role})")[0]
        color = line.get_color()
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlim(lo, hi)
  ax.set_ylim(lo, hi)
  ax.set_xlabel("paper (its own unit: ms, samples/s, x, fraction)")
  ax.set_ylabel("model")
  ax.set_title("cost model against the papers' figures")
  ax.legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Directory for fidelity.json and fidelity.png.", required=True)
flags.DEFINE_list("papers", list(PAPERS), f"Papers: {', '.join(PAPERS)}.")


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.papers) - set(PAPERS))
  if unknown:
    raise app.UsageError(f"--papers {unknown} unknown; papers: {list(PAPERS)}")
  rows = collect(FLAGS.papers)
  print(format_table(rows))
  for name in FLAGS.papers:
    if name in CONSISTENCY:
      print("\n" + CONSISTENCY[name]())
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "fidelity.json"), "w") as f:
    json.dump(rows, f, indent=1)
  plot(rows, os.path.join(FLAGS.out_dir, "fidelity.png"))
  print(f"wrote {FLAGS.out_dir}/fidelity.json and fidelity.png")


if __name__ == "__main__":
  app.run(main)
