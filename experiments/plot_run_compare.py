"""Which config fields differ between the runs `experiments.plot_run` draws: read from their config.json, else from
what their metrics.jsonl shows."""

import os

from moejax import run_config


def run_names(workdirs: list[str]) -> list[str]:
  """Each run's name: its folder's name, or its whole path where two runs' folders share a name."""
  names = [os.path.basename(os.path.normpath(w)) or w for w in workdirs]
  return names if len(set(names)) == len(names) else [os.path.normpath(w) for w in workdirs]


# What a metrics.jsonl shows of its run's config, for workdirs without config.json.
RECORD_FACTS = {
  "MoE layers": lambda rs: len(rs[0].get("expert_load", [])),
  "experts per MoE layer": lambda rs: len(rs[0]["expert_load"][0]) if rs[0].get("expert_load") else 0,
  "tokens per step": lambda rs: round(rs[-1]["tokens_per_s"] * rs[-1]["step_time_s"]),
  "peak learning rate": lambda rs: max(r["learning_rate"] for r in rs),
}


def compare(workdirs: dict[str, str], records: dict[str, list[dict]]) -> tuple[dict, str]:
  """({field: {run: value}} of the fields that differ between the runs, what they were read from): the runs'
  config.json where every run has one (its fields and the versions that ran it, not its resume history), else the
  RECORD_FACTS of their records."""
  configs = {name: run_config.read(workdir) for name, workdir in workdirs.items()}
  missing = [name for name, config in configs.items() if config is None]
  if not missing:
    configs = {name: {k: v for k, v in config.items() if k != "history"} for name, config in configs.items()}
    return run_config.differences(configs), f"their {run_config.CONFIG_FILE}"
  facts = {name: {fact: read(rs) for fact, read in RECORD_FACTS.items()} for name, rs in records.items()}
  return run_config.differences(facts), (
    f"what metrics.jsonl shows ({', '.join(RECORD_FACTS)}): no {run_config.CONFIG_FILE} in {', '.join(missing)}"
  )


def difference_lines(differences: dict, source: str) -> list[str]:
  """'fields that differ (read from SOURCE):' and one line per field, 'field: run value, run value'."""
  if not differences:
    return [f"no field differs (read from {source})"]
  return [f"fields that differ (read from {source}):"] + [
    f"  {field}: " + ", ".join(f"{name} {value}" for name, value in values.items())
    for field, values in differences.items()
  ]
