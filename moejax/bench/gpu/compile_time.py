"""The compile_time step: the train step's compile time against depth, layers scanned and unrolled, on one device.

Each point is configs/decoder.py's tiny `family` (fp32) with model.num_layers set to one of the depths, layers scanned
(model.scan_layers=True: one compiled body per segment) or unrolled, one micro-batch of TOKENS: a Trainer on abstract
state (nothing is initialised), the step's trace and lowering timed, then its compilation, wall and CPU seconds (the
process' threads summed), and the lowered program's lines (StableHLO text). Each family's shallowest scanned point is
compiled first and kept apart ('warmups'): the imports, the backend's start and, on a GPU, XLA's autotuning of the
family's matmuls (cached by the process for the points after it) are in it, not in the points.

The same mechanism (training_config, measure, sweep, table, check_sweep) is what experiments/compile_time.py runs on
its 2 x 4 mesh of simulated CPU devices; this step runs it on a 1 x 1 mesh, the families and depths from
configs/gpu_suite.py's compile_families / compile_layers / compile_scan (smoke: SMOKE_FAMILIES, SMOKE_LAYERS).
"""

import time

from moejax.bench.gpu.record import Record, say
from moejax.validation import is_int, require

TOKENS = (8, 32)  # sequences x tokens of the one micro-batch, as experiments/compile_time.py's default
SMOKE_FAMILIES = ("qwen3_moe",)
SMOKE_LAYERS = (2,)  # one depth, scanned and unrolled: each compile takes ~10 s on a CPU


def training_config(family: str, layers: int, scan: bool, batch_size: int, seq_len: int, nodes: int, gpus: int):
  """configs/decoder.py's tiny `family` with `layers` layers (DeepSeek's dense first layers kept first) on a mesh of
  `nodes` x `gpus` devices."""
  from configs import decoder  # pylint: disable=import-outside-toplevel

  config = decoder.get_config(family)
  dense = decoder.TINY[family].get("dense", 0)
  config.model.update(num_layers=layers, moe_layers=tuple(i >= dense for i in range(layers)), scan_layers=scan)
  config.update(batch_size=batch_size, micro_batches=1, seq_len=seq_len)
  config.mesh.update(nodes=nodes, gpus_per_node=gpus)
  config.moe.update(num_nodes=nodes)
  config.data.shards = nodes * gpus
  return config


def measure(config) -> dict:
  """Seconds to trace and lower the train step and to compile it, wall and CPU (this process' threads), and the
  lowered program's lines, on the mesh of config.mesh."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from moejax.models import state as state_lib  # pylint: disable=import-outside-toplevel
  from moejax.runtime import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from moejax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from moejax.train import objective  # pylint: disable=import-outside-toplevel
  from moejax.train import trainer as train  # pylint: disable=import-outside-toplevel

  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  mesh = mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  trainer = train.Trainer(config, *config_lib.validate(config), mesh, tok, donate=False)
  _, _, rest = state_lib.abstract_state(trainer.model_cfg, trainer.moe_cfg, mesh, config.seed)
  batch = jax.ShapeDtypeStruct((1, config.batch_size, config.seq_len), jnp.int32, sharding=trainer.batch_sharding)
  clocks = lambda: (time.perf_counter(), time.process_time())
  start = clocks()
  lowered = trainer.step.lower(trainer.abstract_state, rest, batch)
  lowered_at = clocks()
  lowered.compile()
  done = clocks()
  return {
    "trace_lower_s": lowered_at[0] - start[0],
    "compile_s": done[0] - lowered_at[0],
    "total_s": done[0] - start[0],
    "trace_lower_cpu_s": lowered_at[1] - start[1],
    "compile_cpu_s": done[1] - lowered_at[1],
    "total_cpu_s": done[1] - start[1],
    "program_lines": len(lowered.as_text().splitlines()),
  }


def check_sweep(families, layers, scan, prefix: str = "") -> None:
  """The sweep's fields (named `prefix` + families, layers, scan); errors name the field."""
  from configs import decoder  # pylint: disable=import-outside-toplevel

  require(
    families and all(f in decoder.TINY for f in families),
    f"{prefix}families",
    families,
    f"a non-empty tuple of {sorted(decoder.TINY)}",
  )
  require(
    layers and all(is_int(n, 2) for n in layers),
    f"{prefix}layers",
    layers,
    "a non-empty tuple of ints >= 2 (DeepSeek's first layer is dense)",
  )
  require(scan and all(isinstance(s, bool) for s in scan), f"{prefix}scan", scan, "a non-empty tuple of True / False")


def sweep(families, layers, scans, batch_size: int, seq_len: int, nodes: int, gpus: int):
  """Yields (is_warmup, point): for each family its shallowest scanned step compiled first (the warm-up), then one
  point per scan (in `scans`' order) and depth."""
  for family in families:
    for scan in (None, *scans):  # None: the warm-up
      for depth in (min(layers),) if scan is None else layers:
        config = training_config(family, depth, True if scan is None else scan, batch_size, seq_len, nodes, gpus)
        point = {"family": family, "layers": depth, "scan_layers": config.model.scan_layers, **measure(config)}
        say(
          f"{family} {depth} layers, scan_layers={point['scan_layers']}{' (warm-up)' if scan is None else ''}: "
          f"{point['total_s']:.1f} s wall, {point['total_cpu_s']:.1f} CPU s (trace + lower "
          f"{point['trace_lower_s']:.1f} s, compile {point['compile_s']:.1f} s wall)"
        )
        yield scan is None, point


def table(points: list[dict], key: str = "total_cpu_s", unit: str = "CPU s") -> str:
  """One row per family and depth: `key`'s seconds of trace + lower + compile, unrolled and scanned, each with its
  ratio to the family's shallowest, and the lowered program's lines."""
  lines = [
    f"{'family':<12} {'layers':>6}  {'unrolled ' + unit:>14} {'(ratio)':>8}  {'scanned ' + unit:>14} "
    f"{'(ratio)':>8}  {'lines unrolled':>14} {'scanned':>8}"
  ]
  cell = {(p["family"], p["layers"], p["scan_layers"]): p for p in points}
  for family in dict.fromkeys(p["family"] for p in points):
    depths = sorted({p["layers"] for p in points if p["family"] == family})
    for layers in depths:
      parts = []
      for scan in (False, True):
        p, first = cell.get((family, layers, scan)), cell.get((family, depths[0], scan))
        parts.append(f"{p[key]:>14.1f} {p[key] / first[key]:>7.2f}x" if p and first else f"{'':>14} {'':>8}")
      sizes = [
        str(cell[(family, layers, s)]["program_lines"]) if (family, layers, s) in cell else "" for s in (False, True)
      ]
      lines.append(f"{family:<12} {layers:>6}  {parts[0]}  {parts[1]}  {sizes[0]:>14} {sizes[1]:>8}")
  return "\n".join(lines)


def ratios(points: list[dict]) -> list[dict]:
  """Per family and depth: wall seconds scanned and unrolled, scanned / unrolled, and each against the family's
  shallowest depth of the same kind (None where a point is missing)."""
  cell = {(p["family"], p["layers"], p["scan_layers"]): p["total_s"] for p in points}
  rows = []
  for family in dict.fromkeys(p["family"] for p in points):
    depths = sorted({p["layers"] for p in points if p["family"] == family})
    for layers in depths:
      row = {"family": family, "layers": layers}
      for name, scan in (("scanned", True), ("unrolled", False)):
        here, first = cell.get((family, layers, scan)), cell.get((family, depths[0], scan))
        row[f"{name}_s"] = here
        row[f"{name}_vs_{depths[0]}_layers"] = here / first if here and first else None
      row["scanned_over_unrolled"] = (
        row["scanned_s"] / row["unrolled_s"] if row["scanned_s"] and row["unrolled_s"] else None
      )
      rows.append(row)
  return rows


def step_compile_time(config, rec: Record):
  families, layers = (
    (SMOKE_FAMILIES, SMOKE_LAYERS) if config.smoke else (config.compile_families, config.compile_layers)
  )
  batch, seq_len = TOKENS
  rec.data.update(
    mesh="1x1",
    families=list(families),
    layers=list(layers),
    scan=list(config.compile_scan),
    batch=batch,
    seq_len=seq_len,
    dtype="float32",
  )
  warmups, points = [], []
  rec.data.update(warmups=warmups, points=points)
  for is_warmup, point in sweep(families, layers, config.compile_scan, batch, seq_len, 1, 1):
    (warmups if is_warmup else points).append(point)
    rec["ratios"] = ratios(points)
    rec.save()
  say("wall seconds of trace + lower + compile, ratios to the shallowest:\n" + table(points, "total_s", "s"))
