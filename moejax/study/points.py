"""The points of a scaling sweep: its config checked, the layer config and cluster it names, and the keys
that let reruns skip finished points."""

import dataclasses
import functools
import hashlib
import json
import os

import ml_collections

from moejax.cost import fitted
from moejax.cost import topology as topology_lib
from moejax.moe.config import MoEConfig
from moejax.study import schemes as schemes_lib
from moejax.study import sweep_checks
from moejax.study.schemes import NODEDUP
from moejax.validation import ConfigError, is_int, reject_unknown, require

# The sweep's schemes as schemes of the one table (`moejax.study.schemes`); the flat top-k routing is MoEConfig's
# default. '<scheme>_nodedup': <scheme> with a row per token-choice in every hop, to compare with <scheme>, which
# takes moe.dedup (None: deduplicated).
SWEEP_SCHEMES = {
  "switch": "switch+capacity",
  "flat_dropless": "flat",
  "hierarchical": "gpu_first",
  "smile": "smile+node_first",
  "node_limited": "node_limited+node_first",
  "smile_nodedup": "smile+node_first" + NODEDUP,
  "node_limited_nodedup": "node_limited+node_first" + NODEDUP,
  "chunked": "flat+chunked",
  "comet": "flat+comet",
  "esp_baseline": "capacity+esp_baseline",
  "s1": "capacity+s1",
  "s2": "capacity+s2",
}
SCHEMES = tuple(SWEEP_SCHEMES)
# The dropping schemes' capacity factors: the sweep's own moe fields.
CAPACITY_FIELDS = {
  "switch": "switch_capacity_factor",
  "smile": "smile_capacity_factor",
  **{s: "esp_capacity_factor" for s in ("esp_baseline", "s1", "s2")},
}


def _table_fields(scheme: str) -> dict:
  """The fields a sweep scheme takes from the table (on one CPU node: which fields, not their values)."""
  return schemes_lib.fields(SWEEP_SCHEMES[scheme], 1)


# Overlap schedules of the flat dropless layer (Comet): they move its rows in pieces, so its small run serves them.
OVERLAP_SCHEMES = tuple(s for s in SCHEMES if "schedule" in _table_fields(s))
# Parm's expert-sharding schedules: experts over 'node', d_ff over 'gpu'; dense capacity dispatch, priced analytically.
ESP_SCHEMES = {s: _table_fields(s)["esp_schedule"] for s in SCHEMES if "esp_schedule" in _table_fields(s)}
SCALINGS = ("weak", "strong")
# MoEConfig fields each scheme sets (from the mesh, the model or its own moe.*_capacity_factor; and transport, the old
# name of path and collective), so the sweep's moe section leaves them out; every other MoEConfig field in it is passed
# to every scheme that does not fix it.
SCHEME_FIELDS = (
  "num_experts",
  "d_model",
  "d_ff",
  "routing",
  "path",
  "collective",
  "transport",
  "num_nodes",
  "capacity_factor",
  "schedule",
  "esp_schedule",
)
# The sweep's own moe fields: experts per device, and each dropping scheme's capacity factor.
SWEEP_FIELDS = ("experts_per_gpu", "switch_capacity_factor", "smile_capacity_factor", "esp_capacity_factor")


@dataclasses.dataclass(frozen=True)
class Point:
  """One point of the sweep; `label` is 'modelled' or 'measured'."""

  scheme: str
  nodes: int
  gpus_per_node: int
  model: str
  scaling: str
  label: str = "modelled"

  @property
  def devices(self) -> int:
    return self.nodes * self.gpus_per_node

  @property
  def mesh(self) -> str:
    return f"{self.nodes}x{self.gpus_per_node}"


def scheme_config(scheme: str, n: int, m: int, moe, d_model: int, d_ff: int) -> MoEConfig:
  """The MoEConfig of a sweep scheme (SWEEP_SCHEMES) on an n x m mesh (`moe`: the sweep's `config.moe`, whose
  fields every scheme takes where it sets none, e.g. dedup and the wire dtypes; the dropping schemes their
  CAPACITY_FIELDS)."""
  common = {name: value for name, value in moe.items() if name not in SWEEP_FIELDS}
  common.update(num_experts=moe.experts_per_gpu * n * m, d_model=d_model, d_ff=d_ff)
  fields = schemes_lib.fields(SWEEP_SCHEMES[scheme], n)
  capacity = CAPACITY_FIELDS.get(scheme.removesuffix(NODEDUP))
  if capacity:
    fields["capacity_factor"] = moe[capacity]
  try:
    return MoEConfig(**{**common, **fields})
  except ConfigError as e:
    if e.field == "capacity_factor" and capacity:
      field = f"moe.{capacity}"
    elif e.field == "num_experts":
      field = "moe.experts_per_gpu"
    else:  # errors name what the user wrote
      field = f"moe.{e.field}" if e.field in moe else e.field
    require(False, field, e.value, f"{e.allowed} (scheme {scheme!r} on mesh {n}x{m})")


def check_moe_fields(moe) -> None:
  """The sweep's moe section holds SWEEP_FIELDS and any MoEConfig field but SCHEME_FIELDS; errors name the field."""
  for name in SCHEME_FIELDS:
    require(name not in moe, f"moe.{name}", moe.get(name), "unset: each scheme sets it")
  known = SWEEP_FIELDS + tuple(f.name for f in dataclasses.fields(MoEConfig) if f.name not in SCHEME_FIELDS)
  reject_unknown(moe, known, "moe.")  # one line: each unknown field's nearest known ones
  for name in SWEEP_FIELDS:
    require(name in moe, f"moe.{name}", None, "set: the sweep needs it")


def moe_section(config, model: str):
  """The moe section `model`'s points take: config.moe with models.<model>.moe's fields over it."""
  own = config.models[model].get("moe")
  if not own:
    return config.moe
  return ml_collections.ConfigDict({**config.moe.to_dict(), **own.to_dict()})


def simulated_scheme(scheme: str) -> str | None:
  """The scheme whose small run gives `scheme`'s traffic; None: priced from the config alone."""
  if scheme in ESP_SCHEMES:
    return None
  return "flat_dropless" if scheme in OVERLAP_SCHEMES else scheme


def base_topology(config) -> topology_lib.Topology:
  """The preset `config.topology` with `config.topology_overrides` ('nic_bw=25e9,...') applied."""
  overrides = topology_lib.parse_overrides(config.topology_overrides)
  if not overrides:
    return topology_lib.get(config.topology)
  return topology_lib.custom(config.topology, name=f"{config.topology}+{config.topology_overrides}", **overrides)


def calibration(config) -> fitted.Calibration | None:
  """The calibration of the record calibration.source names (`moejax.cost.fitted`) on `base_topology`; None without
  one. ('measure' must have been replaced by the record's path: experiments/scaling.py does.)"""
  if not config.calibration.source:
    return None
  return _load_calibration(config.calibration.source, _file_digest(config), config.topology, config.topology_overrides)


@functools.lru_cache(maxsize=8)
def _load_calibration(path: str, digest: str, preset: str, overrides: str) -> fitted.Calibration:
  """The record at `path` fitted once per content (`digest`) and base topology."""
  del digest  # a key of the cache only: a record written again is fitted again
  base = base_topology(ml_collections.ConfigDict({"topology": preset, "topology_overrides": overrides}))
  return fitted.load(path, base, os.path.basename(path))


def topology(config) -> topology_lib.Topology:
  """The topology every point is priced on: `base_topology`, with the calibration's fitted terms where there is
  one."""
  calibrated = calibration(config)
  return calibrated.topology if calibrated else base_topology(config)


def validate(config) -> list[Point]:
  """Checks every field before JAX starts (`sweep_checks`); returns the modelled points in run order."""
  require(
    config.topology in topology_lib.PRESETS, "topology", config.topology, f"one of {sorted(topology_lib.PRESETS)}"
  )
  try:
    base_topology(config)
  except ValueError as e:
    require(False, "topology_overrides", config.topology_overrides, f"field=value,... of topology fields ({e})")
  sweep_checks.check_sources(config)
  sweep_checks.check_meshes(config, base_topology(config)["gpus_per_node"])
  for field, allowed in (("schemes", SCHEMES), ("scalings", SCALINGS)):
    value = config[field]
    require(
      isinstance(value, (tuple, list)) and len(value) > 0 and set(value) <= set(allowed),
      field,
      value,
      f"a non-empty tuple of {allowed}",
    )
  require(is_int(config.gemm_sms), "gemm_sms", config.gemm_sms, "a positive int (SMs of the GPU, for the wave model)")
  require(len(config.models) > 0, "models", config.models, "at least one named model")
  for name, model in config.models.items():
    sweep_checks.check_model(name, model, config.moe, SCHEME_FIELDS)
  sweep_checks.check_sim_and_measure(config)
  meshes = [(n, m) for m in config.gpus_per_node for n in config.nodes]
  if "strong" in config.scalings:
    sweep_checks.check_global_batch(config, meshes)
  check_moe_fields(config.moe)
  for n, m in meshes:
    for scheme in config.schemes:
      for name in config.models:
        scheme_config(scheme, n, m, moe_section(config, name), config.sim.d_model, config.sim.d_ff)
  return [
    Point(scheme, n, m, name, scaling)
    for n, m in meshes
    for scheme in config.schemes
    for name in config.models
    for scaling in config.scalings
  ]


def max_devices(points: list[Point]) -> int:
  return max(p.devices for p in points)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _file_digest(config) -> str:
  """A digest of the calibration record's bytes ('' without one), so that a new record reprices every point."""
  source = config.calibration.source
  if not source:
    return ""
  with open(source, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def point_key(point: Point, config) -> str:
  """A digest of everything the point's row depends on, so reruns skip only identical points."""
  model = config.models[point.model].to_dict()
  if point.label == "measured":  # timed: the topology and the calibration play no part
    settings = {"moe": config.moe.to_dict(), "sim": config.sim.to_dict(), "measure": config.measure.to_dict()}
  else:
    settings = {
      "topology": config.topology,
      "topology_overrides": config.topology_overrides,
      "device_rate_json": config.device_rate_json,
      "gemm_sms": config.gemm_sms,
      "moe": config.moe.to_dict(),
      "sim": config.sim.to_dict(),
      "calibration": _file_digest(config),
    }
  if point.scaling == "strong":
    settings["global_batch"] = config.global_batch
  return _digest([dataclasses.asdict(point), model, settings])


# moe fields no small run reads: the pricing's (the wire dtypes change a row's bytes, not the rows: `simulate` runs
# without them), and esp_cost (read by esp_schedule='auto' only, which no scheme uses).
_PRICING_ONLY = ("num_chunks", "esp_capacity_factor", "esp_cost", "dispatch_dtype", "combine_dtype")


# What a small run records; a new version reruns the small runs of earlier sweeps (2: its control collectives).
SIMULATION_VERSION = 2


def simulation_key(scheme: str, n: int, m: int, config, moe) -> str:
  """A digest of what a small run depends on (`moe`: the model's moe section, `moe_section`); models, topology,
  scaling and the pricing-only moe fields only reprice it."""
  moe = {k: v for k, v in moe.to_dict().items() if k not in _PRICING_ONLY}
  return _digest([scheme, n, m, moe, config.sim.to_dict(), SIMULATION_VERSION])


def identity(point: Point) -> dict:
  """The fields of a row that name its point."""
  return {
    "scheme": point.scheme,
    "nodes": point.nodes,
    "gpus_per_node": point.gpus_per_node,
    "devices": point.devices,
    "model": point.model,
    "scaling": point.scaling,
    "label": point.label,
  }
