"""A run's config as printed (`--print_config`) and kept in its workdir: the JSON of the resolved ConfigDict, read
back and compared field by field (`differences`: which dotted fields differ between runs, and their values)."""

import json
import os

import ml_collections

CONFIG_FILE = "config.json"  # in a training workdir: the config the run was started with
ABSENT = "(absent)"  # a field one run's config has and another's lacks


def dumps(config: ml_collections.ConfigDict) -> str:
  """`config` as indented JSON (tuples as lists)."""
  return config.to_json_best_effort(indent=1)


def read(workdir: str) -> dict | None:
  """The config stored in `workdir` (CONFIG_FILE) as a plain dict; None when the workdir has none."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def flatten(tree: dict, prefix: str = "") -> dict:
  """{'moe.top_k': 2, ...}: the leaves of nested dicts under dotted names (lists stay values)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def differences(configs: dict[str, dict]) -> dict[str, dict[str, object]]:
  """{field: {run: value}} for every dotted field whose value is not the same in all of `configs` ({run: config}),
  in the order the fields first appear; a run without the field shows ABSENT."""
  flat = {name: flatten(config) for name, config in configs.items()}
  fields = dict.fromkeys(field for config in flat.values() for field in config)
  table = {field: {name: config.get(field, ABSENT) for name, config in flat.items()} for field in fields}
  return {
    field: values
    for field, values in table.items()
    if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1
  }
