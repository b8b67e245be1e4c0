"""The `moe` section of an experiment config, built from `MoEConfig`'s fields so that every config exposes each
field (new ones included) at the dataclass's default unless the config overrides it.

Fields that may be None (capacity_factor, buffer_factor, esp_schedule, ...) take a value or None from the
command line: `--config.moe.capacity_factor=None` is dropless, `--config.moe.capacity_factor=1.25` drops.
"""

import dataclasses
import typing

import ml_collections

from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, reject_unknown, require

NoneType = type(None)


def _optional(field: dataclasses.Field, hint) -> bool:
  return field.default is None or NoneType in typing.get_args(hint)


def moe_section(*, omit: tuple[str, ...] = (), **overrides) -> ml_collections.ConfigDict:
  """Every MoEConfig field except `omit` (those the experiment derives elsewhere, e.g. the trainer's d_model and
  d_ff from model.*), at its default or its value in `overrides`; fields without a default must be overridden.

  A field that may be None is an untyped reference: a typed one (placeholder(float)) would take flags through
  absl's float parser, which rejects 'None', and a str field turns `=None` into the string 'None'; untyped, the
  flag is read as a Python literal, and MoEConfig checks its type. A FieldReference override is kept, so the
  field follows what it refers to; fields that must agree with the mesh (num_nodes) are copies, checked against it
  (moejax.validation.check_against_mesh), never references that would resize the mesh from the moe section."""
  fields = dataclasses.fields(MoEConfig)
  known = [f.name for f in fields] + ["transport"]
  reject_unknown(set(overrides) | set(omit), known, "moe.")
  for name in sorted(set(overrides) & set(omit)):
    require(False, f"moe.{name}", overrides[name], "unset: the experiment derives it (omitted from its moe section)")
  hints = typing.get_type_hints(MoEConfig)
  section = {}
  for field in fields:
    if field.name in omit:
      continue
    if field.name in overrides:
      value = overrides[field.name]
    elif field.default is not dataclasses.MISSING:
      value = field.default
    elif field.default_factory is not dataclasses.MISSING:
      value = field.default_factory()
    else:
      raise ConfigError(
        f"config field moe.{field.name} is missing: MoEConfig has no default for it",
        f"moe.{field.name}",
        None,
        "a value set by the config",
      )
    if isinstance(value, ml_collections.FieldReference):
      section[field.name] = value
    elif _optional(field, hints[field.name]):
      section[field.name] = ml_collections.FieldReference(value, field_type=object)
    elif hints[field.name] is float and isinstance(value, int) and not isinstance(value, bool):
      section[field.name] = float(value)  # else the field would be an int one and `=0.5` would not parse
    else:
      section[field.name] = value
  if "transport" not in omit:  # the old name of path and collective, read by MoEConfig with a notice; None: unused
    section["transport"] = ml_collections.FieldReference(overrides.get("transport"), field_type=object)
  return ml_collections.ConfigDict(section)
