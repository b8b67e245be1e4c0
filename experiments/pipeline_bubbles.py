"""The pipeline schedules' bubbles, counted from each schedule's own timetable (`moejax.pipeline.schedules`), beside
the published formula.

  python -m experiments.pipeline_bubbles                                              # prints the tables
  python -m experiments.pipeline_bubbles --workdir=benchmarks/results/2026-11-27-cpu  # and pipeline_bubbles.json

For every schedule, p (config.stages) and m (config.micro_batches) the schedule can run, at two sets of per-stage
times (F = B = 1, W = 0; and config.f, b, w, fb), it records each device's idle time within the makespan, the
makespan and the idle fraction, and the published bubble (a device's idle time, `Schedule.published_bubble`):
  gpipe, 1f1b   (p-1)(F+B)                  (GPipe; DeepSeek-V3 report Table 2 for 1F1B)
  interleaved   (p-1)(F+B)/v                (Megatron, Narayanan et al. 2021: (p-1)/(vm) of the ideal m(F+B))
  dualpipe(v)   (p/2-1)(F&B+B-3W)           (DeepSeek-V3 report Table 2; DualPipe's README for DualPipeV)
The interleaved schedule's chunks take 1/v of a stage's times, so every schedule does the same work per stage.
It also draws every schedule's timetable at config.picture (p, m) with the second set of times, as text and (with
--workdir) as pipeline_timetables.png.
"""

import os

from moejax import cli
from moejax.pipeline import schedules
from moejax.pipeline.timetable import Durations, draw, figure
from moejax.validation import ConfigError, is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "pipeline_bubbles.py")


def row(schedule: str, p: int, m: int, v: int, d: Durations) -> dict:
  """One schedule at one shape: its counted bubble, or why it cannot run there."""
  chunks = schedules.of(schedule).chunks(v)
  times = Durations(d.f / chunks, d.b / chunks, d.w / chunks, None if d.fb is None else d.fb / chunks)
  record = {
    "schedule": schedule,
    "stages": p,
    "micro_batches": m,
    "virtual_stages": chunks,
    "durations": {"f": d.f, "b": d.b, "w": d.w, "fb": d.fb},
  }
  try:
    table = schedules.timetable(schedule, p, m, chunks, times)
  except ConfigError as e:
    return {**record, "refused": str(e)}
  idle = [table.idle(device) for device in range(len(table.slots))]
  return {
    **record,
    "devices": len(idle),
    "idle": idle,
    "busiest_idle": max(idle),
    "makespan": table.makespan,
    "bubble_fraction": table.bubble_fraction(),
    "published_idle": schedules.of(schedule).published_bubble(p, chunks, d),
  }


def run(config) -> dict:
  sets = (Durations(), Durations(config.f, config.b, config.w, config.fb))
  rows = [
    row(s, p, m, config.virtual_stages, d)
    for d in sets
    for s in config.schedules
    for p in config.stages
    for m in config.micro_batches
  ]
  return {"rows": rows}


def markdown(record: dict) -> str:
  """docs/pipelines.md's tables: per duration set, each schedule and p against m: the busiest device's counted idle
  time (the published formula's in brackets) and the idle fraction of all devices' time."""
  out = []
  for durations in {tuple(r["durations"].values()): r["durations"] for r in record["rows"]}.values():
    rows = [r for r in record["rows"] if r["durations"] == durations]
    ms = sorted({r["micro_batches"] for r in rows})
    out += [
      f"F = {durations['f']:g}, B = {durations['b']:g}, W = {durations['w']:g}, F&B = "
      f"{'F + B' if durations['fb'] is None else format(durations['fb'], 'g')}:",
      "",
      "| schedule | p | " + " | ".join(f"m = {m}" for m in ms) + " |",
      "|---|--:|" + "--:|" * len(ms),
    ]
    for schedule, p in dict.fromkeys((r["schedule"], r["stages"]) for r in rows):
      cells = []
      for r in sorted(
        (r for r in rows if (r["schedule"], r["stages"]) == (schedule, p)), key=lambda r: r["micro_batches"]
      ):
        cells.append(
          "—" if "refused" in r else f"{r['busiest_idle']:.4g} ({r['published_idle']:.4g}) · {r['bubble_fraction']:.3f}"
        )
      out.append(f"| {schedule} | {p} | " + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out)


def picture_timetables(config) -> list:
  """Each schedule's timetable at config.picture = (p, m) and config's times (a chunk of interleaved 1/v of them)."""
  p, m = config.picture
  tables = []
  for schedule in config.schedules:
    v = schedules.of(schedule).chunks(config.virtual_stages)
    tables.append(
      schedules.timetable(schedule, p, m, v, Durations(config.f / v, config.b / v, config.w / v, config.fb / v))
    )
  return tables


def pictures(tables: list, virtual_stages: int) -> str:
  """The timetables as text (`timetable.draw`, 4 characters a unit of time, 4 a chunk's for interleaved)."""
  width = lambda t: 4 * schedules.of(t.name).chunks(virtual_stages)
  return "\n".join(f"{t.name}:\n{draw(t, width=width(t))}\n" for t in tables)


def check(config) -> None:
  for name in ("stages", "micro_batches"):
    values = getattr(config, name)
    require(
      isinstance(values, tuple) and values and all(is_int(x) for x in values), name, values, "a tuple of positive ints"
    )
  require(
    isinstance(config.schedules, tuple) and set(config.schedules) <= set(schedules.PIPELINED),
    "schedules",
    config.schedules,
    f"a tuple of {sorted(schedules.PIPELINED)}",
  )
  require(isinstance(config.picture, tuple) and len(config.picture) == 2, "picture", config.picture, "(p, m)")
  require(is_int(config.virtual_stages, 2), "virtual_stages", config.virtual_stages, "an int >= 2")
  for name in ("f", "b", "w", "fb"):
    require(is_number(getattr(config, name)), name, getattr(config, name), "a time >= 0")
  try:
    Durations(config.f, config.b, config.w, config.fb)
  except ValueError as e:
    raise ConfigError(str(e), "w") from None


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  record = run(config)
  tables = picture_timetables(config)
  print(markdown(record), pictures(tables, config.virtual_stages), sep="\n", flush=True)
  if workdir:
    cli.write_json(workdir, "pipeline_bubbles.json", record)
    path = os.path.join(workdir, "pipeline_timetables.png")
    figure(tables).savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/pipeline_bubbles.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for pipeline_bubbles.json and pipeline_timetables.png (optional: without it, the tables only).",
    required=False,
  )
  cli.run(main)
