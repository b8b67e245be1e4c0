"""Replication in training: slot tables carried in the train state, re-planned online from measured
loads without changing the model, and recorded. (Checkpointed and restored with their re-plan window:
test_train's kill-and-resume test, which runs with re-planning.)"""

import os

import numpy as np
import pytest

from configs import mlm
from moejax.moe import replicas
from moejax.train import metrics
from moejax.train import replan as replan_lib
from moejax.train import trainer as train

pytestmark = pytest.mark.slow  # training runs with online re-planning

STEPS = 6


def _config(shared, replan_every, steps=STEPS):
  config = mlm.get_config()
  config.steps = steps
  config.moe.slots_per_device = 2
  config.moe.replan_every = replan_every
  config.data.cache_dir = str(shared / "cache")
  config.checkpoint.every_steps = steps
  config.log.update(tensorboard=False, every_steps=1)
  return config


def test_busiest_loads_and_planner():
  counts = np.array([[40, 0, 0, 0, 10, 10, 10, 10]], np.float64)  # expert 0 takes half the tokens
  initial = replicas.initial_table(8, 4, 3)[None]
  with_tables, without = replan_lib.busiest_loads(counts, initial)
  assert without == [pytest.approx(40 / 20)]  # device 0 holds experts 0, 1 (loads 40 + 0); mean 20
  planner = replan_lib.Replanner(every=2, window=2, nodes=2, per_node=2, slots=3)
  assert not planner.due(1) and planner.due(2)
  planner.observe(counts)
  planner.observe(0 * counts)  # the window's mean is half of `counts`: the same plan
  table = planner.plan()
  assert table.shape == (1, 4, 3) and table.dtype == np.int32
  planned, unreplicated = replan_lib.busiest_loads(counts, table)
  assert planned[0] < 1.05 < with_tables[0] and unreplicated == without


@pytest.fixture(scope="module")
def runs(shared, tmp_path_factory):
  """Six steps of the tiny MLM with two slots per device, re-planned every 2 steps and never."""
  base = tmp_path_factory.mktemp("replan")
  out = {}
  for name, every in (("replan", 2), ("fixed", 0)):
    out[name] = base / name
    train.train(_config(shared, every), str(out[name]))
  return out


def test_replanning_keeps_the_losses_and_balances_the_load(runs, shared):
  replanned, fixed = (metrics.read_jsonl(os.path.join(runs[k], "metrics.jsonl")) for k in ("replan", "fixed"))
  assert [r["step"] for r in replanned] == list(range(1, STEPS + 1))
  for key in ("loss", "task_loss", "accuracy"):
    np.testing.assert_allclose([r[key] for r in replanned], [r[key] for r in fixed], rtol=1e-5, err_msg=key)
  initial = replicas.initial_table(8, 8, 2)
  tables = [np.asarray(r["replanned_slot_tables"]) for r in replanned if "replanned_slot_tables" in r]
  assert len(tables) == STEPS // 2 and any((t != initial).any() for t in tables)
  assert not any("replanned_slot_tables" in r for r in fixed)
  # The same counts (same model): without replication both runs' busiest device is the same.
  assert [r["busiest_load_unreplicated"] for r in replanned] == [r["busiest_load_unreplicated"] for r in fixed]
  for r in replanned[2:]:  # after the first re-plan the busiest device is less loaded than without replicas
    assert r["busiest_load"][0] < r["busiest_load_unreplicated"][0], r
  print(
    "busiest device / mean, with and without re-planned replicas:",
    [(r["busiest_load"][0], r["busiest_load_unreplicated"][0]) for r in replanned],
  )
  summary = metrics.summarize(replanned)
  assert summary["mean_busiest_load"] < summary["mean_busiest_load_unreplicated"]
