"""expert_backend='auto': the fastest expert backend for a layer's per-device FFN shape, read from a measured table.

A table is what the GPU suite's kernels step (or `python -m experiments.bench_kernels --config.backend_table=True`)
writes: for each FFN shape (d, f, experts = groups in one call, gated, activation, rows, skew) and pass ('fwd',
'fwd_bwd') the median seconds of every candidate backend that ran. Tables measured on a device ship in
`expert_tables/<device>.json` (named by `device_key`); `MoEConfig.expert_table` points at another. Nothing is
extrapolated: 'auto' is refused, naming what is missing and how to measure it, unless the table was measured on this
device kind, in the layer's dtype, at its d, f, experts, gated and activation, and at a row count within a factor
MAX_ROWS_RATIO of its own.
"""

import dataclasses
import json
import math
import os

import jax
from absl import logging

from moejax.moe import experts as experts_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError

# The MoEConfig.expert_backend values a table ranks; 'dense' (the reference loop) is never a candidate, nor 'fp8'
# (a choice of precision, not of speed: 'auto' never changes the numerics).
CANDIDATES = ("pallas", "pallas_saved", "pallas_unfused", "ragged_dot", "tokamax")
SHAPE_KEYS = ("model", "d", "f", "experts", "gated", "activation", "rows", "skew", "passes")
MATCH_KEYS = ("d", "f", "experts", "gated", "activation")
MAX_ROWS_RATIO = 4.0
TABLES_DIR = os.path.join(os.path.dirname(__file__), "expert_tables")
PASSES = ("fwd", "fwd_bwd")


def table_from_results(results: list[dict], meta: dict) -> dict:
  """The table of bench_kernels results (dicts with SHAPE_KEYS, 'op', 'impl' and 'median_s', or 'skipped' or
  'error'): per FFN shape and pass the median seconds of every candidate that ran, the fastest of them, the
  references (the other implementations: dense_capacity, torch_grouped_mm, dense_gemm, fp8; never chosen) and what
  was not measured and why.
  `meta`: device (its device_kind), platform, dtype, smoke, versions, source."""
  rows = {}
  for e in results:
    if e["op"] != "ffn":
      continue
    key = tuple(e[k] for k in SHAPE_KEYS)
    row = rows.setdefault(
      key, {**dict(zip(SHAPE_KEYS, key)), "candidates_median_s": {}, "references_median_s": {}, "not_measured": {}}
    )
    if "median_s" not in e:
      row["not_measured"][e["impl"]] = e.get("skipped") or e.get("error")
    elif e["impl"] in CANDIDATES:
      row["candidates_median_s"][e["impl"]] = e["median_s"]
    else:
      row["references_median_s"][e["impl"]] = e["median_s"]
  for row in rows.values():
    candidates = row["candidates_median_s"]
    for name in CANDIDATES:
      if name not in candidates:
        row["not_measured"].setdefault(name, "not run")
    row["fastest"] = min(candidates, key=candidates.get) if candidates else None
  return {
    **meta,
    "op": "ffn",
    "candidates": list(CANDIDATES),
    "note": (
      "pallas = expert_backend='pallas' (the fused FFN, recomputing the hidden pre-activations in the "
      "backward); pallas_saved = the fused FFN keeping its pre-activations for the backward; "
      "pallas_unfused = expert_backend='pallas_unfused' (separate Pallas gmm calls, the hidden "
      "activations kept for the backward); medians of the timed calls"
    ),
    "shapes": list(rows.values()),
  }


def device_key(device_kind: str) -> str:
  """A table's file name for a jax device_kind: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3', 'cpu' -> 'cpu'.
  Exact: an H200 does not read an H100's table."""
  return "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_")


@dataclasses.dataclass(frozen=True)
class FFNShape:
  """One device's expert FFN call in a layer: `experts` groups of d x f weights over `rows` routed rows."""

  d: int
  f: int
  experts: int
  rows: int
  gated: bool
  activation: str
  dtype: str


def layer_shape(cfg: MoEConfig, tokens: int, nodes: int, gpus_per_node: int) -> FFNShape:
  """The FFN shape one device computes for `tokens` global tokens per layer call, balanced: its slots (or local
  experts), d_ff (/ m with expert sharding, whose node's GPUs each take every row of the node's experts), and
  tokens x K rows spread over the expert holders."""
  holders = cfg.expert_holders(nodes, gpus_per_node)
  experts = cfg.slots_per_device or cfg.num_experts // holders
  sharded = cfg.sharding_kind.splits_d_ff
  rows = tokens * cfg.choices_per_token // (nodes * gpus_per_node) * (gpus_per_node if sharded else 1)
  return FFNShape(
    cfg.d_model,
    cfg.d_ff // gpus_per_node if sharded else cfg.d_ff,
    experts,
    max(rows, 1),
    cfg.gated,
    cfg.activation,
    cfg.dtype,
  )


def measure_command(shape: FFNShape) -> str:
  """How to measure `shape` on the device at hand, for a table expert_table can name."""
  return (
    f"`python -m experiments.bench_kernels --config.shape={shape.d},{shape.f},{shape.experts},"
    f"{int(shape.gated)},{shape.activation} --config.rows={shape.rows} --config.ops=ffn --config.dtype={shape.dtype} "
    "--config.backend_table=True --workdir=DIR` on this device and set expert_table='DIR/backend_table.json', or "
    "name a backend"
  )


def load_table(source: str | None, device_kind: str, shape: FFNShape) -> tuple[dict, str]:
  """(table, its path): `source` (a path) or the table shipped for `device_kind`; refused when there is none or it
  was measured on another device kind (the error says how to measure `shape`)."""
  path = source or os.path.join(TABLES_DIR, device_key(device_kind) + ".json")
  if not os.path.exists(path):
    shipped = sorted(n[:-5] for n in os.listdir(TABLES_DIR) if n.endswith(".json"))
    raise ConfigError(
      f"expert_backend='auto' needs a table measured on this device kind ({device_kind!r}): "
      + (
        f"expert_table={source!r} does not exist"
        if source
        else f"moejax ships tables for {shipped}, not {device_key(device_kind)!r}"
      )
      + "; measure the layer's shape "
      "with " + measure_command(shape),
      "expert_backend",
      "auto",
      f"one of {CANDIDATES} or 'dense'",
    )
  with open(path) as f:
    table = json.load(f)
  if device_key(table.get("device", "")) != device_key(device_kind):
    raise ConfigError(
      f"expert table {path} was measured on {table.get('device')!r}, this is {device_kind!r}: a "
      "ranking does not carry over between devices",
      "expert_table",
      source,
    )
  return table, path


def choose(table: dict, shape: FFNShape, passes: str, allowed: tuple = CANDIDATES) -> tuple[str, dict]:
  """(the fastest measured candidate of `allowed`, the table row it came from) for `shape` and `passes` (balanced
  groups, the measured row count nearest in log scale, within MAX_ROWS_RATIO); ConfigError naming what is missing
  otherwise."""
  if passes not in PASSES:
    raise ValueError(f"passes={passes!r}: one of {PASSES}")
  dtype = table.get("dtype")
  want = {k: getattr(shape, k) for k in MATCH_KEYS}
  timed = lambda r: {k: v for k, v in r["candidates_median_s"].items() if k in allowed}
  rows = [
    r
    for r in table["shapes"]
    if r["passes"] == passes and r["skew"] == "balanced" and timed(r) and all(r[k] == v for k, v in want.items())
  ]
  measured = sorted({tuple(r[k] for k in MATCH_KEYS) + (r["rows"],) for r in table["shapes"]})
  how = "measure it with " + measure_command(shape)
  if dtype != shape.dtype or not rows:
    raise ConfigError(
      f"expert_backend='auto': no {passes} measurement in {shape.dtype} at the layer's per-device FFN "
      f"shape {want} (the table has {dtype} at (d, f, experts, gated, activation, rows) = {measured}); " + how,
      "expert_backend",
      "auto",
      f"one of {CANDIDATES} or 'dense'",
    )
  row = min(rows, key=lambda r: abs(math.log(r["rows"] / shape.rows)))
  if max(row["rows"], shape.rows) / min(row["rows"], shape.rows) > MAX_ROWS_RATIO:
    raise ConfigError(
      f"expert_backend='auto': the layer computes {shape.rows} rows per device, the nearest "
      f"measurement at its shape {want} has {row['rows']} (more than {MAX_ROWS_RATIO:g}x apart); " + how,
      "expert_backend",
      "auto",
      f"one of {CANDIDATES} or 'dense'",
    )
  return min(timed(row), key=timed(row).get), row


def resolve(cfg: MoEConfig, tokens: int, mesh: jax.sharding.Mesh, passes: str = "fwd_bwd") -> MoEConfig:
  """cfg with expert_backend='auto' replaced by the fastest backend the table measured for the layer's per-device
  shape (`layer_shape`, `tokens` global tokens per layer call on `mesh`) and `passes` ('fwd_bwd' to train, 'fwd' to
  serve) on the mesh's device kind. Called where the mesh is made (the Trainer, `moejax.models.from_hf`,
  `moejax.infer.load`, the demo): the layer refuses 'auto'. Other configs come back unchanged."""
  if not cfg.backend_kind.needs_resolving:
    return cfg
  device_kind = mesh.devices.flat[0].device_kind
  shape = layer_shape(cfg, tokens, *mesh_lib.axis_sizes(mesh))
  table, path = load_table(cfg.expert_table, device_kind, shape)
  fused_runs = experts_lib.fused_refusal(cfg) is None  # not with biases or the clamped SwiGLU
  runs = tuple(c for c in CANDIDATES if fused_runs or not experts_lib.BACKENDS[c].fused)
  backend, row = choose(table, shape, passes, runs)
  times = ", ".join(
    f"{k} {v * 1e3:.3f} ms" for k, v in sorted(row["candidates_median_s"].items(), key=lambda kv: kv[1])
  )
  logging.info(
    "expert_backend='auto' -> %r for %s (%s, %d rows measured; %s; not measured: %s) from %s",
    backend,
    shape,
    passes,
    row["rows"],
    times,
    sorted(row["not_measured"]) or "none",
    path,
  )
  return dataclasses.replace(cfg, expert_backend=backend)
