"""MoEConfig's own checks: a bad or unknown field is named with its value and what is allowed, a capacity collective needs
a capacity factor; the experts divide over the mesh's devices."""

import dataclasses
import logging

import pytest

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
