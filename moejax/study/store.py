"""The records of a sweep's workdir: finished points and small runs, one JSON object a line."""

import json
import os

from absl import logging

POINTS_FILE = "points.jsonl"
SIMULATIONS_FILE = "simulations.jsonl"


def load_jsonl(path: str) -> dict[str, dict]:
  """key -> record of a JSONL file of records with a 'key' field ({} if there is no file).

  A last line without its newline is a record cut off by an interrupted run: it is removed (logged with its
  length), so the next append starts on a line of its own; the file is rewritten to a temporary and renamed over
  the old one, so a run killed while repairing it loses no finished record.
  """
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    text = f.read()
  complete, _, cut = text.rpartition("\n")
  if cut:
    logging.warning("%s: dropping an unfinished last record (%d characters)", path, len(cut))
    with open(path + ".tmp", "w") as f:
      f.write(complete + "\n" if complete else "")
    os.replace(path + ".tmp", path)
  records = [json.loads(line) for line in complete.split("\n") if line.strip()]
  return {record["key"]: record for record in records}


def append(f, record: dict) -> None:
  f.write(json.dumps(record) + "\n")
  f.flush()
