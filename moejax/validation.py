"""Config validation shared by every section: one error type, checks that name the field, and the one way fields are
named in errors (a section's prefix, e.g. 'moe.', and the nearest matches of a misspelt field)."""

import difflib
from typing import Any, Callable


class ConfigError(ValueError):
  """A bad config field or input; `field` names it where there is one."""

  def __init__(self, message: str, field: str | None = None, value: Any = None, allowed: str | None = None):
    super().__init__(message)
    self.field, self.value, self.allowed = field, value, allowed


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
  """Raises ConfigError naming `field`, its `value` and what is `allowed` unless `ok`."""
  if not ok:
    raise ConfigError(f"config field {field}={value!r} is not allowed: {allowed}", field, value, allowed)


def is_int(value, low: int = 1) -> bool:
  """An int (not a bool) of at least `low`."""
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


def is_number(value) -> bool:
  """An int or float (not a bool)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def nearest(name: str, known, limit: int = 3) -> list[str]:
  """At most `limit` of `known` closest to the misspelt `name` (difflib's ratio, at least 0.6), best first; those
  clearly farther than the best (under 0.9 of its ratio) are left out."""
  close = difflib.get_close_matches(name, sorted(known), n=limit, cutoff=0.6)
  ratio = lambda c: difflib.SequenceMatcher(None, name, c).ratio()
  return [c for c in close if ratio(c) >= 0.9 * ratio(close[0])]


def unknown_field_message(unknown, known, prefix: str = "") -> str:
  """One line naming each unknown field with `prefix` and its nearest known fields (never the whole list):
  "unknown config field moe.schedul (did you mean moe.schedule?)"."""
  known = sorted(known)
  parts = []
  for name in sorted(unknown):
    close = [prefix + c for c in nearest(name, known)]
    if close:
      hint = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
      parts.append(f"{prefix}{name} (did you mean {hint}?)")
    else:
      section = prefix.rstrip(".") or "the config"
      parts.append(f"{prefix}{name} (no close match among the {len(known)} fields of {section})")
  return f"unknown config field{'s' if len(parts) > 1 else ''} {'; '.join(parts)}"


def reject_unknown(fields, known, prefix: str = "") -> None:
  """Raises ConfigError (one line, the nearest matches) unless every name in `fields` is in `known`."""
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise ConfigError(
      unknown_field_message(unknown, known, prefix),
      prefix + unknown[0],
      None,
      f"a field of {prefix.rstrip('.') or 'the config'}",
    )


def prefixed(prefix: str, fn: Callable, *args, **kwargs):
  """`fn(*args, **kwargs)` with a ConfigError's field named as the config spells it, `prefix` first (e.g. 'moe.'
  for a MoEConfig check run on a config's moe section)."""
  try:
    return fn(*args, **kwargs)
  except ConfigError as e:
    if e.field is None or e.field.startswith(prefix):
      raise
    if e.allowed is not None:
      require(False, prefix + e.field, e.value, e.allowed)
    raise ConfigError(f"config field {prefix}{e.field}: {e}", prefix + e.field, e.value, e.allowed) from None


def check_against_mesh(cfg, nodes: int, gpus_per_node: int, prefix: str = "moe.", mesh: str = "mesh.") -> None:
  """`cfg.check_mesh(nodes, gpus_per_node)` (a MoEConfig's, or a model config's) whose errors name both the config's
  field (with `prefix`) and the mesh fields it must agree with: a mesh is never resized to fit a config's section,
  nor the other way."""
  try:
    cfg.check_mesh(nodes, gpus_per_node)
  except ConfigError as e:
    if e.field is None:
      raise
    require(
      False,
      prefix + e.field,
      e.value,
      f"{e.allowed}, to agree with {mesh}nodes={nodes} and {mesh}gpus_per_node={gpus_per_node}",
    )
