"""The 2026 families' shapes as transformers writes them: one record a family in `hf_shapes/FAMILY.json`, written by
`tests/fixtures/make_published_configs.py` with transformers' own config classes. The training configs
(configs/decoder.py) and the scaling sweep's point models (`moejax.study.point_models`) read them.

A record: checkpoint (the published model's name), parameters (transformers' count at the published size), config
(the published config.json's fields), tiny (the test fixture's config.json fields) and transformers (its version)."""

import functools
import json
import os

RECORDS_DIR = os.path.join(os.path.dirname(__file__), "hf_shapes")
FAMILIES = tuple(sorted(name[: -len(".json")] for name in os.listdir(RECORDS_DIR) if name.endswith(".json")))


@functools.cache
def _record(family: str) -> str:
  with open(os.path.join(RECORDS_DIR, f"{family}.json")) as f:
    return f.read()


def record(family: str) -> dict:
  """Family `family`'s record (module docstring), a fresh dict each call; an unknown family is a ValueError naming
  the known ones."""
  if family not in FAMILIES:
    raise ValueError(f"no published shape for family {family!r}; known: {FAMILIES}")
  return json.loads(_record(family))
