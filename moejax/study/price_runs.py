"""The measured points of one or more runs of a sweep against the timed programs' own prices
(`measure.price_program`), checked against a bound: every point's error within `each`, their median |error|
within `median`, per run and per quantity (the layer forward, the training step).

  runs = {name: price_runs.load(workdir) for ...}     # each sweep workdir's measured rows
  print(price_runs.points_table(runs)); print(price_runs.summary_table(runs))

No price here is fitted to a point: the sweep prices each from terms timed by microbenchmarks on its mesh.
"""

import json
import os

import numpy as np

from moejax.validation import require

# (quantity, measured field, priced field, error field, unit of the table)
QUANTITIES = (
  ("layer", "layer_ms", "priced_layer_ms", "priced_layer_error", "ms"),
  ("step", "step_s", "priced_step_s", "priced_step_error", "s"),
)
EACH, MEDIAN = 0.25, 0.10  # issue 58's bound: every point within 25%, the median within 10%


def load(workdir: str) -> list[dict]:
  """The measured rows with priced errors of a sweep workdir's results.json, in the sweep's order."""
  path = os.path.join(workdir, "results.json")
  require(os.path.isfile(path), "sweep workdir", workdir, "a workdir with results.json (run the sweep first)")
  with open(path) as f:
    rows = [r for r in json.load(f)["rows"] if r["label"] == "measured" and r.get("priced_layer_error") is not None]
  require(rows, "sweep workdir", workdir, "measured points priced from their programs (measure.price_program)")
  return rows


def point(row: dict) -> tuple:
  """A measured row's point: (model, scaling, scheme, nodes x gpus)."""
  return row["model"], row["scaling"], row["scheme"], f"{row['nodes']}x{row['gpus_per_node']}"


def summary(rows: list[dict], error: str, each: float = EACH, median: float = MEDIAN) -> dict:
  """{median_abs, low, high, within, points, met} of the `error` field over `rows`: met when every |error| <= each and
  their median <= median."""
  errors = np.asarray([r[error] for r in rows], float)
  middle = float(np.median(np.abs(errors)))
  within = int(np.sum(np.abs(errors) <= each))
  return dict(
    median_abs=middle,
    low=float(errors.min()),
    high=float(errors.max()),
    within=within,
    points=len(rows),
    met=bool(within == len(rows) and middle <= median),
  )


def _joined(values, fmt: str) -> str:
  return " / ".join("-" if v is None else format(v, fmt) for v in values)


def points_table(runs: dict) -> str:
  """A markdown table, a line per point of any run: per quantity the measured value, the price and the error in
  each run ('a / b / c', runs in order)."""
  keys = list(dict.fromkeys(point(r) for rows in runs.values() for r in rows))
  found = {name: {point(r): r for r in rows} for name, rows in runs.items()}
  head = ["model", "scaling", "scheme", "mesh"]
  for quantity, _, _, _, unit in QUANTITIES:
    head += [f"{quantity} {unit}", f"priced {quantity} {unit}", f"{quantity} error"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key in keys:
    cells = list(key)
    rows = [found[name].get(key) for name in runs]
    for _, measured, priced, error, unit in QUANTITIES:
      digits = ".0f" if unit == "ms" else ".2f"
      cells += [
        _joined([r and r[measured] for r in rows], digits),
        _joined([r and r[priced] for r in rows], digits),
        _joined([r and r[error] for r in rows], "+.0%"),
      ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# The layer's split: (part, the profile's fields summed (`moejax.study.phase_timing`), the price's field)
SPLIT = (
  ("collectives", ("layer_inter_node_ms", "layer_intra_node_ms"), "priced_layer_collectives_ms"),
  ("compute", ("layer_expert_ms", "layer_other_ms"), "priced_layer_compute_ms"),
)


def split_of(row: dict) -> dict:
  """{part: (profiled ms, priced ms)} of a measured row's layer (`SPLIT`); a part is None where the row lacks it (no
  profile, an older sweep). The profile's collectives hold each device's waits at them: a device waits there while
  another still computes, so the profiled split is a device's, not the host's."""
  split = {}
  for part, profiled, priced in SPLIT:
    values = [row.get(f) for f in (*profiled, priced)]
    ok = all(v is not None and np.isfinite(v) for v in values)
    split[part] = (sum(values[:-1]), values[-1]) if ok else None
  return split


def split_table(runs: dict) -> str:
  """A markdown table, a line per point of any run: the layer's time in collectives and in compute, profiled and
  priced ('a / b / c', runs in order; `split_of`)."""
  keys = list(dict.fromkeys(point(r) for rows in runs.values() for r in rows))
  found = {name: {point(r): split_of(r) for r in rows} for name, rows in runs.items()}
  head = ["model", "scaling", "scheme", "mesh"]
  for part, *_ in SPLIT:
    head += [f"{part} profiled ms", f"{part} priced ms"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for key in keys:
    cells = list(key)
    splits = [found[name].get(key) for name in runs]
    for part, *_ in SPLIT:
      for side in (0, 1):
        cells.append(_joined([s and s[part] and s[part][side] for s in splits], ".0f"))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def summary_table(runs: dict, each: float = EACH, median: float = MEDIAN) -> str:
  """A markdown table, a line per run: per quantity the median |error|, the range and how many points are within
  `each`, then whether the bound (every point within `each`, the median within `median`) is met in every run."""
  heads = [f"{quantity}: median \\|error\\|, range, within {each:.0%}" for quantity, *_ in QUANTITIES]
  lines = ["| run | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
  met = []
  for name, rows in runs.items():
    cells = []
    for _, _, _, error, _ in QUANTITIES:
      s = summary(rows, error, each, median)
      met.append(s["met"])
      cells.append(f"{s['median_abs']:.0%}, {s['low']:+.0%} to {s['high']:+.0%}, {s['within']} of {s['points']}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  verdict = "met" if all(met) else "not met"
  lines.append(
    f"\nthe bound (every point within {each:.0%}, the median within {median:.0%}, in every run): {verdict} "
    f"({sum(met)} of {len(met)} run-quantities)"
  )
  return "\n".join(lines)


def record(runs: dict, each: float = EACH, median: float = MEDIAN) -> dict:
  """The JSON of `runs`: per run and quantity its `summary`, and every point's measured, priced and error values."""
  return {
    "each": each,
    "median": median,
    "runs": {
      name: {
        quantity: dict(
          summary(rows, error, each, median),
          rows=[
            dict(zip(("model", "scaling", "scheme", "mesh"), point(r)), measured=r[m], priced=r[p], error=r[error])
            for r in rows
          ],  # fmt: skip
        )
        for quantity, m, p, error, _ in QUANTITIES
      }
      for name, rows in runs.items()
    },
  }
