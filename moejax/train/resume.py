"""A training workdir's config.json and the rules for resuming a workdir with another config.

config.json is the run's resolved config (`moejax.run_config`: what --print_config prints, a preset applied) with
two more top-level keys: `versions` (moejax, jax, jaxlib and the git commit of the code that last started the run,
'+dirty' with uncommitted changes) and `history`, one entry per start that changed the config: the step it resumed
after, how (`resume`: 'same' where only HARMLESS fields changed, 'continue', 'branch' with the workdir it was
branched `from`), the `changed` fields as [old, new] and the `versions` before.

Starting a workdir that holds checkpoints compares the config with its config.json, field by field. HARMLESS
fields may change (how long; how often to log, evaluate and checkpoint: nothing a step computes). Any other
difference is refused before anything is read or compiled, naming each field old -> new, unless checkpoint.resume
is 'continue' (train on with the new config; the history records the change) or 'branch' (copy the run --
checkpoints, metrics.jsonl, config.json and its cache -- into checkpoint.branch_dir and continue the copy there;
the workdir is left as it was; a branch_dir holding checkpoints already is resumed, under the same rules). A
workdir whose checkpoints predate config.json is resumed with a notice.
"""

import json
import os
import shutil
import subprocess

import jax
import jaxlib
import ml_collections
from jax.experimental import multihost_utils

import moejax
from moejax import run_config
from moejax.validation import ConfigError, require

META = ("versions", "history")  # config.json's keys that are not config fields
HARMLESS = (
  "steps",
  "log.every_steps",
  "log.tensorboard",
  "log.eval_every",
  "checkpoint.every_steps",
  "checkpoint.keep",
  "checkpoint.use_async",
  "checkpoint.resume",
  "checkpoint.branch_dir",
  "data.prefetch",
  "train.max_nonfinite_steps",  # when the host stops a run; a step computes the same
)
# Fields added after runs were started, with the value that does what those runs did: a config.json without the
# field and a config with that value are the same run.
ADDED = {"train.loss_spike_factor": 0.0}


def versions() -> dict:
  """The versions of the code running now (git: None outside a git checkout)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(moejax.__file__)))
  git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
  try:
    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    commit = head.stdout.strip() + ("+dirty" if status.stdout.strip() else "") if head.returncode == 0 else None
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {"moejax": moejax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "git": commit}


def has_checkpoints(workdir: str) -> bool:
  """Whether `workdir`/checkpoints holds a checkpoint step."""
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def changes(old: dict, config: ml_collections.ConfigDict) -> dict[str, list]:
  """{field: [old, new]} of the dotted fields whose value differs between config.json's `old` and `config`."""
  old = {k: v for k, v in old.items() if k not in META}
  table = run_config.differences({"old": old, "new": json.loads(run_config.dumps(config))})
  same = lambda field, values: values["old"] == run_config.ABSENT and ADDED.get(field, object()) == values["new"]
  return {field: [values["old"], values["new"]] for field, values in table.items() if not same(field, values)}


def prepare(config: ml_collections.ConfigDict, workdir: str, say=print) -> tuple[str, str | None]:
  """(the workdir to train in, the workdir it was just branched from or None): `workdir`, or checkpoint.branch_dir
  (copied from `workdir` first unless it holds checkpoints); ConfigError when the config differs from the
  checkpointed run's in fields other than HARMLESS and checkpoint.resume is 'same'."""
  mode, branch_dir, source = config.checkpoint.resume, config.checkpoint.branch_dir, workdir
  if mode == "branch":
    if not has_checkpoints(branch_dir):
      require(
        has_checkpoints(workdir),
        "checkpoint.resume",
        mode,
        f"'same' or 'continue': {workdir} holds no checkpoint to branch from",
      )
      _copy_run(workdir, branch_dir, copy_cache=not config.data.cache_dir)
      say(f"branched {workdir} into {branch_dir}")
      return branch_dir, workdir
    workdir = branch_dir
  if not has_checkpoints(workdir):
    return workdir, None
  old = run_config.read(workdir)
  if old is None:
    say(
      f"{workdir} holds checkpoints but no {run_config.CONFIG_FILE} (a run from before configs were kept): "
      "resuming without comparing configs"
    )
    return workdir, None
  refused = {f: v for f, v in changes(old, config).items() if f not in HARMLESS}
  listed = ", ".join(f"{field} {old!r} -> {new!r}" for field, (old, new) in refused.items())
  if refused and mode == "branch":  # the branch exists already: branching again would not change it
    raise ConfigError(
      f"checkpoint.branch_dir {workdir} holds a branch already, whose config differs from this one: {listed}. "
      f"Branch {source} with this config into a new --config.checkpoint.branch_dir=DIR, or train the branch on with "
      f"it: --workdir={workdir} --config.checkpoint.resume=continue --config.checkpoint.branch_dir=''",
      "checkpoint.branch_dir",
      workdir,
      "a new directory to branch into, or the branch's own config",
    )
  if refused and mode != "continue":
    raise ConfigError(
      f"{workdir} holds a run whose config differs from this one: {listed}. Set --config.checkpoint.resume=continue "
      f"to train on with this config (recorded in its {run_config.CONFIG_FILE}), --config.checkpoint.resume=branch "
      "--config.checkpoint.branch_dir=DIR to continue a copy of the run in DIR, or use another --workdir",
      "checkpoint.resume",
      mode,
      "'continue' or 'branch' to resume with a changed config",
    )
  return workdir, None


def _copy_run(source: str, target: str, copy_cache: bool) -> None:
  """Copies the run in `source` to `target`: its checkpoints (not those set aside), metrics.jsonl, config.json and,
  with `copy_cache`, its cache (the tokenizer trained for it)."""
  if jax.process_index() == 0:
    os.makedirs(target, exist_ok=True)
    skip = shutil.ignore_patterns("corrupt-*", "*.orbax-checkpoint-tmp-*")
    shutil.copytree(
      os.path.join(source, "checkpoints"), os.path.join(target, "checkpoints"), ignore=skip, dirs_exist_ok=True
    )
    for name in ("metrics.jsonl", run_config.CONFIG_FILE):
      if os.path.exists(os.path.join(source, name)):
        shutil.copy2(os.path.join(source, name), os.path.join(target, name))
    if copy_cache and os.path.isdir(os.path.join(source, "cache")):
      shutil.copytree(os.path.join(source, "cache"), os.path.join(target, "cache"), dirs_exist_ok=True)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("branch copied")


def record(config: ml_collections.ConfigDict, workdir: str, start: int, branched_from: str | None = None) -> None:
  """Writes `config` to `workdir`/config.json with the versions running now; resuming after step `start` > 0 with
  changed fields appends them to the history kept there (a fresh start begins a new history); branched_from: the
  workdir the run was just copied from (recorded even without changes)."""
  old = run_config.read(workdir) if start > 0 else None
  history = list((old or {}).get("history", []))
  changed = changes(old, config) if old is not None else {}
  if changed or branched_from:
    entry = {
      "step": start,
      "resume": config.checkpoint.resume,
      "changed": changed,
      "versions": (old or {}).get("versions"),
    }
    history.append({**entry, "from": branched_from} if branched_from else entry)
  out = {**json.loads(run_config.dumps(config)), "versions": versions(), "history": history}
  path = os.path.join(workdir, run_config.CONFIG_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(out, f, indent=1)
  os.replace(path + ".tmp", path)
