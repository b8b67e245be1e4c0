"""Config validation shared by every section: one error type, and checks that name the field."""

from typing import Any


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
