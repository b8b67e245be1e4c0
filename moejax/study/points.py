"""The points of a scaling sweep: its config checked, the layer config and cluster it names, and the keys
that let reruns skip finished points."""

import dataclasses
import functools
import hashlib
import json
import math
import os

import ml_collections

from moejax.cost import fitted
from moejax.cost import topology as topology_lib
from moejax.moe.config import MoEConfig
from moejax.study import point_models
from moejax.study import schemes as schemes_lib
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
MODEL_FIELDS = ("d_model", "d_ff", "layers", "moe_layers", "seq_len", "micro_batch", "vocab")
# A model's optional fields: its family (`point_models.FAMILIES`; 'bert' if unset) and moe fields of its own, over the
# sweep's moe section (a decoder's top-k and shared experts beside SMILE's top-1).
MODEL_OPTIONS = ("family", "moe")
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


def _positive_ints(value) -> bool:
  return isinstance(value, (tuple, list)) and len(value) > 0 and all(is_int(v) for v in value)


def validate(config) -> list[Point]:
  """Checks every field before JAX starts; returns the modelled points in run order."""
  require(
    config.topology in topology_lib.PRESETS, "topology", config.topology, f"one of {sorted(topology_lib.PRESETS)}"
  )
  try:
    base_topology(config)
  except ValueError as e:
    require(False, "topology_overrides", config.topology_overrides, f"field=value,... of topology fields ({e})")
  source = config.calibration.source
  require(
    source in ("", "measure") or os.path.isfile(source),
    "calibration.source",
    source,
    "'' (the topology as given), 'measure' (time this job's exchanges first) or an existing calibration.json "
    "or bench_collectives record",
  )
  require(
    _positive_ints(config.calibration.rows),
    "calibration.rows",
    config.calibration.rows,
    "a non-empty tuple of positive ints (rows per peer of the timed all-to-alls)",
  )
  require(
    not config.device_rate_json or os.path.isfile(config.device_rate_json),
    "device_rate_json",
    config.device_rate_json,
    "'' (datasheet peak x efficiency) or an existing benchmark JSON",
  )
  for field in ("nodes", "gpus_per_node"):
    require(_positive_ints(config[field]), field, config[field], "a non-empty tuple of positive ints")
  max_gpus = base_topology(config)["gpus_per_node"]
  require(
    max(config.gpus_per_node) <= max_gpus,
    "gpus_per_node",
    config.gpus_per_node,
    f"at most {max_gpus:g}, the GPUs per node of topology {config.topology!r}",
  )
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
    _check_model(name, model, config.moe)
  require(
    isinstance(config.sim.balanced_router, bool), "sim.balanced_router", config.sim.balanced_router, "True or False"
  )
  for field in ("tokens_per_gpu", "batches", "d_model", "d_ff", "seed"):
    value = config.sim[field]
    require(
      isinstance(value, int) and value >= (0 if field == "seed" else 1),
      f"sim.{field}",
      value,
      "an int >= 0" if field == "seed" else "a positive int",
    )
  require(
    config.measure.platform in ("gpu", "cpu"),
    "measure.platform",
    config.measure.platform,
    "'gpu' (time points on the job's GPUs) or 'cpu' (on its CPU devices)",
  )
  unknown = sorted(set(config.measure.models) - set(config.models))
  require(
    not unknown, "measure.models", config.measure.models, f"names of models ({', '.join(config.models)}), or () for all"
  )
  for field in ("warmup", "repeats"):
    require(
      isinstance(config.measure[field], int) and config.measure[field] >= 1,
      f"measure.{field}",
      config.measure[field],
      "a positive int",
    )
  meshes = [(n, m) for m in config.gpus_per_node for n in config.nodes]
  if "strong" in config.scalings:
    works = math.lcm(*(n * m * model.micro_batch for model in config.models.values() for n, m in meshes))
    for name, model in config.models.items():
      for n, m in meshes:
        require(
          is_int(config.global_batch) and config.global_batch % (n * m * model.micro_batch) == 0,
          "global_batch",
          config.global_batch,
          f"a multiple of devices x micro batch = {n * m * model.micro_batch} (mesh {n}x{m}, model {name}) "
          f"for strong scaling; --config.global_batch={works} fits every mesh and model of this sweep "
          f"(or a smaller models.{name}.micro_batch, or --config.scalings=\"('weak',)\")",
        )
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


def _check_model(name: str, model, moe) -> None:
  """One sweep model's fields (MODEL_FIELDS, MODEL_OPTIONS), its family's model built; errors name the field."""
  unknown = sorted(set(model) - set(MODEL_FIELDS + MODEL_OPTIONS))
  require(not unknown, f"models.{name}", unknown, f"only the fields {MODEL_FIELDS + MODEL_OPTIONS}")
  for field in MODEL_FIELDS:
    value = model.get(field)
    require(is_int(value), f"models.{name}.{field}", value, "a positive int")
  family = point_models.family(model)
  require(family in point_models.FAMILIES, f"models.{name}.family", family, f"one of {point_models.FAMILIES}")
  if family == "bert":
    require(
      model.layers % model.moe_layers == 0,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"a divisor of layers={model.layers} (an MoE layer every layers / moe_layers blocks)",
    )
  else:
    require(
      model.moe_layers <= model.layers,
      f"models.{name}.moe_layers",
      model.moe_layers,
      f"at most layers={model.layers} (the others are dense, first)",
    )
  require(model.vocab >= 3, f"models.{name}.vocab", model.vocab, "at least 3 (padding, mask, a token)")
  own = model.get("moe") or {}
  reject_unknown(own, tuple(moe), f"models.{name}.moe.")
  for field in SCHEME_FIELDS:
    require(field not in own, f"models.{name}.moe.{field}", own.get(field), "unset: each scheme sets it")
  try:
    point_models.training_model(model, "float32")
  except ConfigError as e:
    require(False, f"models.{name}.{e.field}", e.value, f"{e.allowed} (the {family} model built from models.{name})")


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


def simulation_key(scheme: str, n: int, m: int, config, moe) -> str:
  """A digest of what a small run depends on (`moe`: the model's moe section, `moe_section`); models, topology,
  scaling and the pricing-only moe fields only reprice it."""
  moe = {k: v for k, v in moe.to_dict().items() if k not in _PRICING_ONLY}
  return _digest([scheme, n, m, moe, config.sim.to_dict()])


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
