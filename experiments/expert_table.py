"""Write the expert-backend table that expert_backend='auto' reads from measured kernel records.

Reads one or more records of the GPU suite's kernels step or of experiments/bench_kernels.py (all from one device
kind, in one dtype, none a smoke run), merges their FFN results (a later record's result replaces an earlier one's
for the same shape, pass and implementation: e.g. a re-run with new tiles) and writes
<workdir>/<device key>.json (`moejax.cost.expert_backend.table_from_results`), the name `expert_backend.load_table`
looks for. The tables moejax ships live in moejax/cost/expert_tables/:

  python -m experiments.expert_table --workdir=moejax/cost/expert_tables --config.records=RECORD.json[,RECORD.json]

The records are config.records (configs/expert_table.py).
"""

import json
import os

from absl import flags

from moejax import cli
from moejax.cost import expert_backend
from moejax.validation import require


def merge(records: list[dict], names: list[str]) -> tuple[list[dict], dict]:
  """(the FFN results, later records first-class, and the table's metadata) of kernel records; refuses records of
  different devices or dtypes, and smoke runs."""
  devices = {r.get("device") or r.get("device_kind") for r in records}
  dtypes = {r["dtype"] for r in records}
  require(
    len(devices) == 1 and len(dtypes) == 1,
    "records",
    names,
    f"records of one device and dtype (these are from devices {sorted(devices)} in dtypes {sorted(dtypes)})",
  )
  smoke = [n for n, r in zip(names, records) if r.get("smoke")]
  require(not smoke, "records", names, f"records of measurements (smoke records measure nothing: {smoke})")
  key = lambda e: tuple(e[k] for k in expert_backend.SHAPE_KEYS) + (e["impl"],)
  merged = {}
  for record in records:
    for e in record["results"]:
      if e["op"] == "ffn":
        merged[key(e)] = e
  first = records[0]
  versions = first.get("versions") or {"jax": first.get("jax_version"), "jaxlib": first.get("jaxlib_version")}
  meta = dict(
    device=devices.pop(),
    platform=first["platform"],
    dtype=dtypes.pop(),
    smoke=False,
    versions=versions,
    source=", ".join(names),
  )
  return list(merged.values()), meta


def write(config, workdir: str) -> None:
  """Merges the config's records and writes their table to `workdir`; prints the fastest backend per shape."""
  paths = config.records
  require(bool(paths), "records", paths, "one or more kernel records (--config.records=A.json,B.json)")
  missing = [p for p in paths if not os.path.isfile(p)]
  require(not missing, "records", ",".join(paths), f"existing files ({missing} are not)")
  records = []
  for path in paths:
    with open(path) as f:
      records.append(json.load(f))
  results, meta = merge(records, [os.path.basename(p) for p in paths])
  table = expert_backend.table_from_results(results, meta)
  os.makedirs(workdir, exist_ok=True)
  out = os.path.join(workdir, expert_backend.device_key(meta["device"]) + ".json")
  with open(out, "w") as f:
    json.dump(table, f, indent=1)
  for row in table["shapes"]:
    times = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in row["candidates_median_s"].items())
    print(
      f"{row['model']:14s} R={row['rows']:6d} {row['skew']:8s} {row['passes']:7s} fastest {row['fastest']} "
      f"({times}; not measured: {sorted(row['not_measured']) or 'none'})"
    )
  print(f"wrote {out}")


def main(argv):
  del argv
  write(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "expert_table.py"),
    "Table config file (configs/expert_table.py).",
  )
  cli.define_workdir("Folder of the table (<device key>.json).")
  cli.run(main)
