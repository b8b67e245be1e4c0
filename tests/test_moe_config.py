"""MoEConfig's own checks: a bad or unknown field is named with its value and what is allowed, a capacity collective needs
a capacity factor; the experts divide over the mesh's devices."""

import dataclasses
import logging

import pytest

from moejax.moe import collective, expert_sharding, experts, path, routing, schedule
from moejax.moe import config as config_lib
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError

BASE = dict(num_experts=8, top_k=2, d_model=16, d_ff=32)


@pytest.mark.parametrize(
  "field,value,allowed",
  [
    ("top_k", 9, "at most 8 for routing='topk'"),
    ("top_k", 0, "a positive int"),
    ("path", "hierarchical", "one of"),
    ("collective", "nccl", "one of"),
    ("transport", "nccl", "the old field"),
    ("routing", "random", "one of"),
    ("expert_backend", "cublas", "one of"),
    ("activation", "tanh", "one of"),
    ("capacity_factor", -1.0, "None"),
    ("dtype", "float16", "one of"),
    ("jitter", 1.5, "in \\[0, 1\\)"),
  ],
)
def test_bad_field_is_named_with_value_and_allowed(field, value, allowed):
  with pytest.raises(ConfigError, match=rf"moe\.{field}={value!r}.*{allowed}"):
    MoEConfig.from_mapping({**BASE, field: value}, prefix="moe.")


def test_capacity_collective_needs_capacity_factor():
  with pytest.raises(ConfigError, match="capacity_factor=None"):
    MoEConfig(**BASE, collective="capacity")


def test_unknown_field_rejected():
  with pytest.raises(ConfigError, match=r"moe\.topk"):
    MoEConfig.from_mapping({**BASE, "topk": 2}, prefix="moe.")


def test_experts_must_divide_over_devices():
  with pytest.raises(ConfigError, match="num_experts=8.*multiple of the mesh's 3 devices"):
    MoEConfig(**BASE).check_mesh(3, 1)
  assert MoEConfig(**BASE).experts_per_holder(2, 2) == 2


@pytest.mark.parametrize(
  "transport,path,collective",
  [
    ("ragged", "flat", "ragged"),
    ("padded", "flat", "padded"),
    ("capacity", "flat", "capacity"),
    ("hierarchical", "gpu_first", "auto"),
    ("bilevel", "node_first", "auto"),
  ],
)
def test_old_transport_is_read_as_path_and_collective(transport, path, collective, caplog):
  """Configs written before the split keep working: each old value is its path and collective, with one notice."""
  with caplog.at_level(logging.WARNING):
    cfg = MoEConfig.from_mapping({**BASE, "transport": transport, "capacity_factor": 1.0}, prefix="moe.")
  assert (cfg.path, cfg.collective) == (path, collective)
  assert [r.getMessage().count("\n") for r in caplog.records if "transport" in r.getMessage()] == [0]
  assert (dataclasses.replace(cfg, top_k=1).path, dataclasses.replace(cfg, top_k=1).collective) == (path, collective)


def test_each_choice_is_a_registry_the_config_asks():
  """Each choice's options are its registry's names, in order, and the rest of the code asks the objects what it needs
  (the capabilities here), never their names."""
  for options, registry in (
    (config_lib.ROUTINGS, routing.ROUTERS),
    (config_lib.PATHS, path.PATHS),
    (config_lib.COLLECTIVES, collective.COLLECTIVES),
    (config_lib.SCHEDULES, schedule.SCHEDULES),
    (config_lib.ESP_SCHEDULES, expert_sharding.SHARDINGS),
    (config_lib.EXPERT_BACKENDS, experts.BACKENDS),
  ):
    assert options == tuple(registry)
  assert [s for s, kind in schedule.SCHEDULES.items() if kind.overlaps] == ["chunked", "comet"]
  assert experts.FUSED == ("pallas", "pallas_saved")
  assert [b for b, kind in experts.BACKENDS.items() if kind.interprets_on("cpu")] == [
    "pallas",
    "pallas_saved",
    "pallas_unfused",
  ]
  assert not any(kind.interprets_on("gpu") for kind in experts.BACKENDS.values())
  assert collective.COLLECTIVES["auto"].resolve("cpu").name == "padded"
  assert [c for c, kind in collective.COLLECTIVES.items() if kind.ring_of_permutes] == ["padded"]
  assert collective.COLLECTIVES["auto"].resolve("gpu").name == "ragged"
  s2 = MoEConfig(**BASE, esp_schedule="s2")
  assert s2.sharding_kind.splits_d_ff and not s2.deduplicates and s2.expert_holders(2, 4) == 2
  edp = MoEConfig(**BASE, expert_data_parallel=True)
  assert not edp.sharding_kind.splits_d_ff and edp.deduplicates and edp.expert_holders(2, 4) == 4
  auto = MoEConfig(**BASE, esp_schedule="auto", expert_backend="auto")
  assert auto.sharding_kind.needs_resolving and auto.backend_kind.needs_resolving
  assert path.hops("gpu_first") == MoEConfig(**BASE, path="gpu_first").path_kind.hops
  assert MoEConfig(**BASE, path="node_first").path_kind.crosses_axes_apart
