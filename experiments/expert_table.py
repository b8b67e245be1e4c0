"""Write the expert-backend table that expert_backend='auto' reads from measured kernel records.

Reads one or more records of the GPU suite's kernels step or of experiments/bench_kernels.py (all from one device
kind, in one dtype, none a smoke run), merges their FFN results (a later record's result replaces an earlier one's
for the same shape, pass and implementation: e.g. a re-run with new tiles) and writes
<workdir>/<device key>.json (`moejax.cost.expert_backend.table_from_results`), the name `expert_backend.load_table`
looks for. The tables moejax ships live in moejax/cost/expert_tables/:

  python -m experiments.expert_table --workdir=moejax/cost/expert_tables --config.records=RECORD.json[,RECORD.json]

The records are config.records (configs/expert_table.py). Another program's workdir is refused
(`moejax.workdir_guard`); the workdir is left unmarked, a folder of tables only (every *.json of the shipped folder
is a device's table). One folder holds the tables of several devices; a device's table written from other records is
kept (refused, naming them), except in the shipped folder, where a table replaces the shipped one (git keeps it).
"""

import json
import os

from absl import flags

from moejax import cli, workdir_guard
from moejax.cost import expert_backend
from moejax.validation import ConfigError, require

PROGRAM = "experiments.expert_table"


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


def check(workdir: str, out: str, source: str) -> None:
  """ConfigError (one line) where `out`, a device's table from the records `source` names, may not be written: the
  workdir is another program's, or `out` was written from other records (outside the shipped folder)."""
  if not workdir_guard.check(workdir, PROGRAM, beside=[expert_backend.TABLES_DIR]) and os.path.isfile(out):
    try:
      with open(out) as f:
        before = json.load(f).get("source")
    except (OSError, ValueError, AttributeError):
      before = None
    if before != source:
      raise ConfigError(
        f"{out} holds the table of other records (records: {json.dumps(before)} there, {json.dumps(source)} now); "
        f"it is kept: use another --workdir for {PROGRAM}",
        "records",
        source,
      )


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
  out = os.path.join(workdir, expert_backend.device_key(meta["device"]) + ".json")
  check(workdir, out, meta["source"])
  os.makedirs(workdir, exist_ok=True)
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
