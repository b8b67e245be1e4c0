"""The --config flag of the experiments: an ml_collections config file whose command-line overrides must name
existing fields.

ml_collections resolves each `--config.a.b=value` against the loaded config and meets a missing field with a
KeyError traceback (at import when the default file is used). Here the loaded config is checked first, so a
misspelt field ends in one flags-parsing error that names it, the closest field and the fields of its section.
"""

import difflib
import re
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

from moejax.validation import ConfigError


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
      fields = sorted(node.keys())
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f" (did you mean {'.'.join([*parents, close[0]])}?)" if close else ""
      raise ConfigError(f"unknown config field {path}{hint}; {section} has {fields}", path)
    node, parents = node[key], [*parents, key]


class _CheckedParser(flags.ArgumentParser):
  """ml_collections' config file parser, then every override of the command line checked against its config."""

  def __init__(self, *, parser: flags.ArgumentParser, name: str):
    self.parser, self.name = parser, name

  def parse(self, argument):
    config = self.parser.parse(argument)
    if isinstance(config, ml_collections.ConfigDict):  # else a load error, reported when the config is read
      for path in override_paths(self.name, flags.FLAGS.read_flags_from_files(sys.argv, force_gnu=False)):
        check_override(config, path)  # a ConfigError (a ValueError) becomes absl's IllegalFlagValueError
    return config

  def flag_type(self):
    return self.parser.flag_type()


def define_config(default: str, help_string: str, name: str = "config",
                  flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file(name, default, help_string)` whose overrides must name existing fields.

  Without --config on the command line the default file is loaded (and its overrides resolved) right here, at
  import, before `app.run` could report a bad flag; such an error exits with absl's flags-parsing message."""
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values)
  flag = flag_values[name]
  flag.parser = _CheckedParser(parser=flag.parser, name=name)
  try:
    flag_values.set_default(name, default)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  return holder
