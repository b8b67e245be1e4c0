"""The --config flag of moejax's programs: an ml_collections config file whose command-line overrides must name
existing fields, and whose every error is one line.

ml_collections resolves each `--config.a.b=value` against the loaded config and meets a missing field with a
KeyError traceback (at import when the default file is used); a config file that does not exist only fails when
the config is first read (two chained tracebacks), and one whose get_config raises is reported with its traceback.
Here the file is loaded and the overrides checked while the flag is parsed, so each of these ends in one error
line naming the file or the field (a misspelt field with its nearest fields, never the whole section): run the
experiment's main with `run(main)` (absl's app.run with a one-line flags error).

A tuple field takes its elements separated by commas (`--config.schemes=switch,smile`, `--config.nodes=1,2`),
each read as the default's elements are (integers, numbers, booleans, else strings); Python's `(1, 2)` is read too.
`--workdir` (`define_workdir`) is the one other flag a program defines: the directory it writes to.
`--print_config` (beside --config, `define_config`) prints the config with its overrides as JSON and exits (the form
a run keeps it in: `moejax.run_config`).

Under absl, INFO lines are shown; JAX logs at INFO each platform it probes and does not find ("Unable to
initialize backend 'tpu'"). That logger is raised to WARNING, unless `--verbosity` asks for debug lines: JAX
still warns when a device it can see fails to start, and raises for a platform named in JAX_PLATFORMS.
"""

import json
import logging
import os
import re
import sys
import traceback

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from moejax import run_config, workdir_guard
from moejax.runtime import distributed
from moejax.validation import ConfigError, unknown_field_message

_BACKEND_PROBE = logging.getLogger("jax._src.xla_bridge")  # JAX's backend probe: INFO for platforms not installed
_BACKEND_PROBE.setLevel(logging.WARNING)


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
      rest = path[len(prefix + key) + 1 :]
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
    return ConfigError(f"config file {path} does not exist (--config=PATH[:ARG], PATH relative to {os.getcwd()})", path)
  cause = error.__context__ if "Error whilst parsing config file" in str(error) and error.__context__ else error
  if isinstance(cause, ConfigError):  # the file's own check of its argument (the flag's name says which file)
    return cause
  lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
  reason = lines[-1] if lines else type(cause).__name__
  if lines and not isinstance(cause, ValueError):
    reason = f"{type(cause).__name__}: {reason}"
  where = [
    f.lineno for f in traceback.extract_tb(cause.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)
  ]
  if isinstance(cause, SyntaxError) and cause.lineno:
    where.append(cause.lineno)
  at = f" (line {where[-1]})" if where else ""
  return ConfigError(f"config file {argument} could not be loaded{at}: {reason}", path)


def _unquoted(text: str) -> str:
  return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _boolean(text: str) -> bool:
  if text.lower() not in ("true", "false"):
    raise ValueError(text)
  return text.lower() == "true"


# How a tuple field's elements are read, by the type of its default's elements: (reader, what the error calls them).
_ELEMENTS = {
  str: (_unquoted, "strings"),
  int: (int, "integers"),
  float: (float, "numbers"),
  bool: (_boolean, "booleans (true or false)"),
}


class TupleFieldParser(flags.ArgumentParser):
  """The tuple field `path` of the flag `name` (default `default`) from `a,b`, `(a, b)` or `[a, b]`: each element
  read as the default's elements are (`_ELEMENTS`), or as a string where the default is empty or mixed."""

  def __init__(self, name: str, path: str, default: tuple):
    self.name, self.path, self.default = name, path, default
    kinds = {type(x) for x in default}
    self.kind = kinds.pop() if len(kinds) == 1 and not kinds - set(_ELEMENTS) else str

  def parse(self, argument) -> tuple:
    if isinstance(argument, tuple):
      return argument
    text = argument.strip()
    if text[:1] + text[-1:] in ("()", "[]"):
      text = text[1:-1]
    items = [item.strip() for item in text.split(",")]
    if items[-1] == "":  # '', '8,' or '(0,)'
      items.pop()
    read, what = _ELEMENTS[self.kind]
    elements = []
    for item in items:
      try:
        elements.append(read(item))
      except ValueError:
        example = ",".join(str(x).lower() if self.kind is bool else str(x) for x in self.default)
        raise ValueError(
          f"config field {self.path} takes {what} separated by commas, e.g. "
          f"--{self.name}.{self.path}={example} (got {item!r})"
        ) from None
    return tuple(elements)

  def flag_type(self):
    return "tuple"


class _TupleFieldFlag(flags.Flag):
  """The override `--{name}.{path}` of a tuple field of `config`, set on it as it is parsed (ml_collections'
  own tuple flag reads Python syntax only, and leaves a field of this name alone)."""

  def __init__(self, config, name: str, path: str):
    super().__init__(
      TupleFieldParser(name, path, config_path.get_value(path, config)),
      flags.ArgumentSerializer(),
      f"{name}.{path}",
      None,
      f"An override of {name}'s field {path}",
    )
    self.config, self.path = config, path

  def parse(self, argument):
    super().parse(argument)
    config_path.set_value(self.path, self.config, self.value)


class _CheckedParser(flags.ArgumentParser):
  """ml_collections' config file parser, then every override of the command line checked against its config."""

  def __init__(self, *, parser: flags.ArgumentParser, name: str, flag_values: flags.FlagValues):
    self.parser, self.name, self.flag_values = parser, name, flag_values

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
        if (
          "[" not in path
          and isinstance(config_path.get_value(path, config), tuple)
          and f"{self.name}.{path}" not in self.flag_values
        ):
          flags.DEFINE_flag(_TupleFieldFlag(config, self.name, path), self.flag_values)
    return config

  def flag_type(self):
    return self.parser.flag_type()


def given_twice(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> str | None:
  """One line where a config flag (`define_config`'s) is given more than once in `argv` (its flag files read):
  absl would keep the last file silently, or fail on its overrides with a flag 'defined twice'."""
  args = flag_values.read_flags_from_files(argv[1:], force_gnu=False)
  for name in [n for n in flag_values if isinstance(flag_values[n].parser, _CheckedParser)]:
    given = [arg for arg in args if re.fullmatch(rf"--?{re.escape(name)}(=.*)?", arg, re.DOTALL)]
    if len(given) > 1:
      times = "twice" if len(given) == 2 else f"{len(given)} times"
      return f"--{name} was given {times} ({', '.join(given)}): give it once, set fields with --{name}.FIELD=VALUE"
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with any flag error as one line on stderr (`error: flag --config=...: ...`) and exit
  status 1, the help flags' output untouched; a config flag given twice is refused first (`given_twice`)."""
  try:
    twice = given_twice(argv)
    if twice:
      sys.exit(f"error: {twice}")
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"error: {e}")


def run(main) -> None:
  """`app.run(main)` whose flag errors (`parse_flags`) and the ConfigErrors `main` raises are one line on stderr
  (`error: ...`, exit status 1); with --print_config, the configs of `define_config` are printed instead."""

  def guarded(argv):
    if absl_logging.get_verbosity() >= absl_logging.DEBUG:  # --verbosity=1 asked for everything
      _BACKEND_PROBE.setLevel(logging.NOTSET)
    if "print_config" in flags.FLAGS and flags.FLAGS.print_config:
      for name in flags.FLAGS:
        if isinstance(flags.FLAGS[name].parser, _CheckedParser):
          print(run_config.dumps(flags.FLAGS[name].value))
      return None
    try:
      return main(argv)
    except ConfigError as e:
      distributed.exit_with(f"error: {e}")

  app.run(guarded, flags_parser=parse_flags)


def write_json(workdir: str, name: str, record) -> str:
  """`record` as indented JSON in workdir/name (the folder made if it is not there); prints and returns the path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, name)
  with open(path + ".tmp", "w") as f:  # replaced whole: a program killed while writing it leaves the one before
    json.dump(record, f, indent=1)
  os.replace(path + ".tmp", path)
  print(f"wrote {path}")
  return path


def define_config(
  default: str, help_string: str, name: str = "config", flag_values: flags.FlagValues = flags.FLAGS
) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file(name, default, help_string)` whose overrides must name existing fields.

  Without --config on the command line the default file is loaded (and its overrides resolved) right here, at
  import, before `app.run` could report a bad flag; such an error exits with the same one line as `parse_flags`."""
  default = os.path.normpath(default)
  _define_print_config(flag_values)
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values)
  flag = flag_values[name]
  flag.parser = _CheckedParser(parser=flag.parser, name=name, flag_values=flag_values)
  try:
    flag_values.set_default(name, default)
  except flags.Error as e:
    sys.exit(f"error: {e}")
  return holder


def _a_directory(value: str | None) -> bool:
  reason = value and workdir_guard.not_a_directory(value)
  if reason:
    raise flags.ValidationError(reason)
  return True


def _define_print_config(flag_values: flags.FlagValues) -> None:
  if "print_config" not in flag_values:
    flags.DEFINE_bool(
      "print_config",
      False,
      "Print the config (the --config file with its overrides) as JSON and exit.",
      flag_values=flag_values,
    )


def define_workdir(
  help_string: str, required: bool = True, flag_values: flags.FlagValues = flags.FLAGS
) -> flags.FlagHolder:
  """`--workdir`, the directory a program writes to: the one flag besides --config and --print_config
  (`define_config`). `required` unless --print_config is given; not `required`, it is None when not given (the
  program then writes nothing but its printed output). A file (`workdir_guard.not_a_directory`) is refused."""
  holder = flags.DEFINE_string("workdir", None, help_string, flag_values=flag_values)
  flags.register_validator("workdir", _a_directory, flag_values=flag_values)
  if required:
    _define_print_config(flag_values)
    flags.register_validator(
      "workdir",
      lambda value: value is not None or flag_values["print_config"].value,
      "Flag --workdir must have a value other than None.",
      flag_values=flag_values,
    )
  return holder
