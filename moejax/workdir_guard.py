"""Which program owns a workdir, so that no program writes over another program's outputs.

A program that writes into its --workdir first calls `claim(workdir, program, settings)`: the workdir's marker
(MARKER, JSON: the owning program and, where its outputs depend on them, the settings that shaped them) is written
on the first claim; a later claim by the same program with the same settings goes on (a resumed or refreshed run),
and any other is refused before anything is written, with one ConfigError line naming the workdir, its owner and the
fix (another --workdir). A claim with other settings names the first setting that differs: the earlier outputs are
kept, never overwritten (a sweep is re-run with other settings into a new workdir).

Workdirs written before markers existed are recognised by what they hold (`owner`): a training run by the trainer's
config.json (`moejax.run_config`, with its versions and history), checkpoints or metrics.jsonl; an export by its
config.json beside safetensors; a sweep by its points.jsonl or results.json (its settings then unknown: the first
claim of a sweep there goes on and records them). A program that only adds its own files beside a run's (a plot of
the run's curves, the run's routing traces) names the runs it reads in `beside`: it may write into those workdirs
and leaves them unmarked. `workdir_argument`: the workdir of a program that also takes it as its one argument
(`python -m experiments.plot_run WORKDIR`, as the trainer prints it). A workdir that is a file (or lies under one)
is refused, naming the file (`not_a_directory`; `moejax.cli.define_workdir` checks it as the flag is parsed).
"""

import json
import os

from moejax import run_config
from moejax.validation import ConfigError

MARKER = "owner.json"  # in a workdir: {"program": "experiments.scaling", "settings": {...} or null}
TRAINER = "experiments.train"  # the owner of a training run's workdir (the trainer writes no marker)
EXPORT = "experiments.export"
SWEEP = "experiments.scaling"

# What each unmarked workdir's owner is called in errors.
KINDS = {TRAINER: "a training run", EXPORT: "a Hugging Face export", SWEEP: "a scaling sweep"}


def not_a_directory(workdir: str) -> str | None:
  """Why `workdir` cannot be made or written into (it, or the folder it would be made in, is an existing file), or
  None: os.makedirs would end in a FileExistsError traceback."""
  path = os.path.abspath(workdir)
  while not os.path.isdir(path):
    # isdir asked again: another process of the job may have made the directory since the loop's test.
    if os.path.lexists(path) and not os.path.isdir(path):
      where = "" if path == os.path.abspath(workdir) else f"{path} is "
      return f"{where}an existing file, not a directory: name a new or existing directory"
    path = os.path.dirname(path)
  return None


def check_directory(workdir: str) -> None:
  """ConfigError (one line) where `workdir` is, or lies under, an existing file."""
  reason = not_a_directory(workdir)
  if reason:
    raise ConfigError(f"--workdir={workdir}: {reason}", "workdir", workdir)


def _is_training_run(workdir: str) -> bool:
  """A trainer's workdir (moejax.train.resume, moejax.train.metrics): its config.json with versions or history,
  a checkpoint step or metrics.jsonl."""
  stored = _read_json(os.path.join(workdir, run_config.CONFIG_FILE))
  if isinstance(stored, dict) and ("versions" in stored or "history" in stored):
    return True
  checkpoints = os.path.join(workdir, "checkpoints")
  if os.path.isdir(checkpoints) and any(name.isdigit() for name in os.listdir(checkpoints)):
    return True
  return os.path.isfile(os.path.join(workdir, "metrics.jsonl"))


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def owner(workdir: str) -> dict | None:
  """{'program': ..., 'settings': ... or None} of the program whose outputs `workdir` holds: its MARKER, else
  what its files show (a training run, an export, a sweep); None for a missing, empty or unrecognised workdir."""
  if not os.path.isdir(workdir):
    return None
  marker = _read_json(os.path.join(workdir, MARKER))
  if isinstance(marker, dict) and "program" in marker:
    return {"program": marker["program"], "settings": marker.get("settings")}
  if _is_training_run(workdir):
    return {"program": TRAINER, "settings": None}
  names = os.listdir(workdir)
  if run_config.CONFIG_FILE in names and any(name.endswith(".safetensors") for name in names):
    return {"program": EXPORT, "settings": None}
  results = _read_json(os.path.join(workdir, "results.json")) if "results.json" in names else None
  if "points.jsonl" in names or (isinstance(results, dict) and "rows" in results):
    return {"program": SWEEP, "settings": None}
  return None


def plain(settings):
  """`settings` as JSON values (a ConfigDict through `run_config.dumps`, tuples as lists), to store and compare."""
  if hasattr(settings, "to_json_best_effort"):
    return json.loads(run_config.dumps(settings))
  return json.loads(json.dumps(settings))


def described(program: str) -> str:
  """'a scaling sweep (experiments.scaling)', or the program's name where it has no kind."""
  return f"{KINDS[program]} ({program})" if program in KINDS else program


def check(workdir: str, program: str, settings=None, beside=()) -> bool:
  """Whether `program` may write into `workdir` with `settings` (ConfigError, one line, where it may not); True
  when the workdir is one of the runs in `beside`, which it writes into without claiming it."""
  check_directory(workdir)
  same = lambda a, b: os.path.realpath(a) == os.path.realpath(b)
  if any(same(workdir, run) for run in beside):
    return True
  found = owner(workdir)
  if found is None:
    return False
  fix = f"use another --workdir for {program}"
  if found["program"] != program:
    raise ConfigError(f"{workdir} holds the outputs of {described(found['program'])}: {fix}", "workdir", workdir)
  if found["settings"] is not None and settings is not None:
    table = run_config.differences({"there": found["settings"], "now": plain(settings)})
    if table:
      field, values = next(iter(table.items()))
      more = f" and {len(table) - 1} more" if len(table) > 1 else ""
      raise ConfigError(
        f"{workdir} holds the outputs of {described(program)} with other settings ({field}: {json.dumps(values['there'])} "
        f"there, {json.dumps(values['now'])} now{more}); they are kept: {fix}",
        "workdir",
        workdir,
      )
  return False


def claim(workdir: str, program: str, settings=None, beside=()) -> None:
  """`check`s that `program` may write into `workdir`, then marks the workdir as its own (made if missing) with
  `settings` (the fields that shape its outputs; None: any); a workdir in `beside` is left unmarked."""
  if check(workdir, program, settings, beside):
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, MARKER)
  record = {"program": program, "settings": None if settings is None else plain(settings)}
  temporary = f"{path}.{os.getpid()}.tmp"  # several processes of one job may claim the same workdir
  with open(temporary, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(temporary, path)


def workdir_argument(argv: list[str], flag: str | None, program: str) -> str:
  """The workdir of a program that also takes it as its one argument (`python -m PROGRAM WORKDIR`; --workdir then
  defined with required=False): the argument or `flag`, the same directory where both are given; ConfigError (one
  line) where neither is, or they differ."""
  given = argv[1:]
  if len(given) > 1:
    raise ConfigError(f"one workdir, not {len(given)}: {' '.join(given)}", "workdir")
  if given and flag and os.path.normpath(given[0]) != os.path.normpath(flag):
    raise ConfigError(f"two workdirs given, {given[0]} and --workdir={flag}: give one", "workdir", flag)
  if not (given or flag):
    raise ConfigError(f"no workdir: python -m {program} WORKDIR (or --workdir=WORKDIR)", "workdir")
  check_directory(given[0] if given else flag)
  return given[0] if given else flag
