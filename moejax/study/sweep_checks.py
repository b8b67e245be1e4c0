"""The scaling sweep's config checked field by field (`moejax.study.points.validate` runs them in order), each
error naming its field."""

import math
import os

from moejax.study import point_models
from moejax.validation import ConfigError, is_int, reject_unknown, require

MODEL_FIELDS = ("d_model", "d_ff", "layers", "moe_layers", "seq_len", "micro_batch", "vocab")
# A model's optional fields: its family (`point_models.FAMILIES`; 'bert' if unset), moe fields of its own, over
# the sweep's moe section (a decoder's top-k and shared experts beside SMILE's top-1), and a 2026 family's record
# (`shape`: 'published' or 'tiny', `moejax.study.hf_point_models`).
MODEL_OPTIONS = ("family", "moe", "shape")


def _positive_ints(value) -> bool:
  return isinstance(value, (tuple, list)) and len(value) > 0 and all(is_int(v) for v in value)


def check_sources(config) -> None:
  """The calibration's source and rows, the device rate's record."""
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


def check_meshes(config, max_gpus: float) -> None:
  """The nodes and GPUs per node swept, at most `max_gpus` (the topology's) per node."""
  for field in ("nodes", "gpus_per_node"):
    require(_positive_ints(config[field]), field, config[field], "a non-empty tuple of positive ints")
  require(
    max(config.gpus_per_node) <= max_gpus,
    "gpus_per_node",
    config.gpus_per_node,
    f"at most {max_gpus:g}, the GPUs per node of topology {config.topology!r}",
  )


def check_sim_and_measure(config) -> None:
  """The small runs' (sim) and the timed points' (measure) fields."""
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
  for field in ("warmup", "repeats", "max_repeats", "layer_max_repeats"):
    require(
      isinstance(config.measure[field], int) and config.measure[field] >= 1,
      f"measure.{field}",
      config.measure[field],
      "a positive int",
    )
  for field in ("max_repeats", "layer_max_repeats"):
    require(
      config.measure[field] >= config.measure.repeats,
      f"measure.{field}",
      config.measure[field],
      f"at least measure.repeats ({config.measure.repeats})",
    )
  require(
    isinstance(config.measure.price_program, bool),
    "measure.price_program",
    config.measure.price_program,
    "True (price each measured program with terms timed on its mesh) or False",
  )
  spread = config.measure.spread
  require(
    isinstance(spread, (int, float)) and 0 < spread < 1,
    "measure.spread",
    spread,
    "the median's relative confidence half-width that stops the repeats, in (0, 1)",
  )


def check_global_batch(config, meshes: list) -> None:
  """Strong scaling's global batch: a multiple of every mesh's devices x every model's micro batch."""
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


def check_model(name: str, model, moe, scheme_fields: tuple) -> None:
  """One sweep model's fields (MODEL_FIELDS, MODEL_OPTIONS; none of `scheme_fields` in its own moe section), its
  family's model built; errors name the field."""
  unknown = sorted(set(model) - set(MODEL_FIELDS + MODEL_OPTIONS))
  require(not unknown, f"models.{name}", unknown, f"only the fields {MODEL_FIELDS + MODEL_OPTIONS}")
  for field in MODEL_FIELDS:
    value = model.get(field)
    require(is_int(value), f"models.{name}.{field}", value, "a positive int")
  family = point_models.family(model)
  families = tuple(point_models.FAMILIES)
  require(family in families, f"models.{name}.family", family, f"one of {families}")
  require(
    model.get("shape") is None or point_models.FAMILIES[family].takes_shape,
    f"models.{name}.shape",
    model.get("shape"),
    f"unset: the {family} model is scaled to the sweep's width (a 2026 family's record takes a shape)",
  )
  point_models.FAMILIES[family].check_layers(name, model)
  require(model.vocab >= 3, f"models.{name}.vocab", model.vocab, "at least 3 (padding, mask, a token)")
  own = model.get("moe") or {}
  reject_unknown(own, tuple(moe), f"models.{name}.moe.")
  for field in scheme_fields:
    require(field not in own, f"models.{name}.moe.{field}", own.get(field), "unset: each scheme sets it")
  try:
    point_models.training_model(model, "float32")
  except ConfigError as e:
    require(False, f"models.{name}.{e.field}", e.value, f"{e.allowed} (the {family} model built from models.{name})")
