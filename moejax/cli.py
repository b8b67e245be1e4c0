"""The --config flag of moejax's programs: an ml_collections config file whose command-line overrides must name
existing fields, and whose every error is one line.

ml_collections resolves each `--config.a.b=value` against the loaded config and meets a missing field with a
KeyError traceback (at import when the default file is used); a config file that does not exist only fails when
the config is first read (two chained tracebacks), and one whose get_config raises is reported with its traceback.
Here the file is loaded and the overrides checked while the flag is parsed, so each of these ends in one error
line naming the file or the field (a misspelt field with its nearest fields, never the whole section): run the
experiment's main with `run(main)` (absl's app.run with a one-line flags error).
"""

import os
import re
import sys
import traceback

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from moejax.validation import ConfigError, unknown_field_message


def override_paths(name: str, argv: list[str]) -> list[str]:
  """The field paths of the `--name.path=value` (or `--noname.path`) overrides in `argv`, as ml_collections
  finds them."""
  pattern = re.compile(rf"-{{1,2}}(no)?{re.escape(name)}\.")
  return [arg.split("=", 1)[0].split(".", 1)[1] for arg in argv if pattern.match(arg)]


def check_override(config, path: str) -> None:
  """Raises ConfigError naming `path` unless each of its dotted parts is a field of `config`."""
  node, parents = config, []
  for key in path.split("."):
    if "[" in key:  # an index into a sequence field: ml_collections checks those
      return
    section = ".".join(parents) or "the config"
    if not isinstance(node, (ml_collections.ConfigDict, dict)):
      raise ConfigError(f"unknown config field {path}: {section} is a value, not a section", path)
    if key not in node:
      prefix = "".join(p + "." for p in parents)
      rest = path[len(prefix + key) + 1:]
      if rest and rest.split(".")[0] in node:  # e.g. mesh.nodes where this config's section holds nodes itself
        raise ConfigError(f"unknown config field {path} (did you mean {prefix}{rest}?)", path)
      message = unknown_field_message([key], node.keys(), prefix)
      raise ConfigError(message.replace(f"field {prefix}{key} ", f"field {path} ", 1) if rest else message, path)
    node, parents = node[key], [*parents, key]


def load_error(argument: str, error: BaseException) -> ConfigError:
  """One line for a config file that could not be loaded: `argument` ('path' or 'path:arg'), the line of the file
  that raised (where known) and why."""
  path = argument.split(":", 1)[0]
  if not os.path.isfile(path):
    return ConfigError(f"config file {path} does not exist (--config=PATH[:ARG], PATH relative to "
                       f"{os.getcwd()})", path)
  cause = error.__context__ if "Error whilst parsing config file" in str(error) and error.__context__ else error
  lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
  reason = lines[-1] if lines else type(cause).__name__
  if lines and not isinstance(cause, ValueError):
    reason = f"{type(cause).__name__}: {reason}"
  where = [f.lineno for f in traceback.extract_tb(cause.__traceback__) if os.path.abspath(f.filename)
           == os.path.abspath(path)]
  if isinstance(cause, SyntaxError) and cause.lineno:
    where.append(cause.lineno)
  at = f" (line {where[-1]})" if where else ""
  return ConfigError(f"config file {argument} could not be loaded{at}: {reason}", path)


class _CheckedParser(flags.ArgumentParser):
  """ml_collections' config file parser, then every override of the command line checked against its config."""

  def __init__(self, *, parser: flags.ArgumentParser, name: str):
    self.parser, self.name = parser, name

  def parse(self, argument):
    try:
      config = self.parser.parse(argument)
    except Exception as e:  # the file or its get_config raised (ml_collections wraps some with a traceback)
      raise load_error(argument, e) from None
    error = getattr(config, "_error", None) if not isinstance(config, ml_collections.ConfigDict) else None
    if isinstance(error, Exception):  # ml_collections' _ErrorConfig: the file could not be read
      raise load_error(argument, error) from None
    if isinstance(config, ml_collections.ConfigDict):
      for path in override_paths(self.name, flags.FLAGS.read_flags_from_files(sys.argv, force_gnu=False)):
        check_override(config, path)  # a ConfigError (a ValueError) becomes absl's IllegalFlagValueError
    return config

  def flag_type(self):
    return self.parser.flag_type()


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with any flag error as one line on stderr (`error: flag --config=...: ...`) and exit
  status 1, the help flags' output untouched."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"error: {e}")


def run(main) -> None:
  """`app.run(main)` whose flag errors are one line (`parse_flags`)."""
  app.run(main, flags_parser=parse_flags)


def define_config(default: str, help_string: str, name: str = "config",
                  flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file(name, default, help_string)` whose overrides must name existing fields.

  Without --config on the command line the default file is loaded (and its overrides resolved) right here, at
  import, before `app.run` could report a bad flag; such an error exits with the same one line as `parse_flags`."""
  default = os.path.normpath(default)
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values)
  flag = flag_values[name]
  flag.parser = _CheckedParser(parser=flag.parser, name=name)
  try:
    flag_values.set_default(name, default)
  except flags.Error as e:
    sys.exit(f"error: {e}")
  return holder
