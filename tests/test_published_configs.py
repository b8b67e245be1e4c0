"""The 2026 families' presets of configs/decoder.py (`moejax/models/hf_shapes/`, written by transformers' own config
classes): at the published size the model and the memory planner's analytic count have transformers' parameter
count of that config, exactly (and so do the older presets' published models, `tests/data/published_counts.json`); the tiny
shape trains from scratch on the 2 x 4 mesh (the loss falls), scanned and FSDP as plain; the specs' errors name the families."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import decoder
from moejax.models import hf_shaped, state
from moejax.models.published import PUBLISHED
from moejax.runtime import mesh as mesh_lib
from moejax.study import memory
from moejax.train import config as config_lib
from moejax.train import trainer as train
from tests import step_checks


def transformers_parameters(family: str) -> int:
  """transformers' count of the published model, less what transformers 5.24 allocates and the model does not have:
  LongCat-Flash's fused gate/up tensor holds rows for the zero-computation experts too (down_proj does not), and
  ERNIE-4.5 counts its routers' score-correction biases as parameters (moejax keeps them as state, `expert_bias`)."""
  record = hf_shaped.record(family)
  hf, count = record["config"], record["parameters"]
  if family == "longcat_flash":
    count -= hf["num_layers"] * hf["zero_expert_num"] * 2 * hf["expert_ffn_hidden_size"] * hf["hidden_size"]
  if family == "ernie4_5_moe":
    moe_layers = (hf["moe_layer_end_index"] - hf["moe_layer_start_index"]) // hf["moe_layer_interval"] + 1
    count -= moe_layers * hf["moe_num_experts"]
  return count


def abstract_count(model_cfg, moe_cfg, mesh) -> int:
  """Every parameter tensor's elements, counted from the abstract state on `mesh` (nothing allocated)."""
  _, params, _ = state.abstract_state(model_cfg, moe_cfg, mesh)
  return sum(math.prod(a.shape) for a in jax.tree.leaves(params))


# The fast tier's sample (`sampled`: the first case) is the cheapest to build: Sarvam's 19 layers.
@pytest.mark.sampled(1)
@pytest.mark.parametrize("family", sorted(decoder.HF_SHAPED, key=lambda family: family != "sarvam_moe"))
def test_published_size_has_transformers_parameter_count(devices, family):
  """Every parameter tensor, counted from the abstract state (nothing allocated) on the 2 x 4 mesh."""
  config = decoder.get_config(f"{family},published")
  model_cfg, moe_cfg = config_lib.validate(config)[:2]
  counted = abstract_count(model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4))
  assert counted == transformers_parameters(family), (counted, hf_shaped.record(family)["checkpoint"])


@pytest.mark.parametrize("family", decoder.HF_SHAPED)
def test_memory_planner_counts_transformers_parameters(family):
  """The memory planner's analytic count (each layer's tensors written out from the config's dimensions by its
  mixer and block kind: `moejax.study.memory_leaves`) at the published size and mesh."""
  config = decoder.get_config(f"{family},published")
  model_cfg, moe_cfg = config_lib.validate(config)[:2]
  counted = memory.analytic_state(model_cfg, moe_cfg, config.mesh.nodes, config.mesh.gpus_per_node)
  assert counted["parameter_count"] == transformers_parameters(family)


# transformers' count of the older presets' published models (`tests/fixtures/make_published_counts.py`), where its
# config class's defaults are that model.
COUNTS = json.loads((Path(__file__).parent / "data" / "published_counts.json").read_text())
OLDER = {spec: entry for spec, entry in decoder.FAMILIES.items() if entry in COUNTS}


# The fast tier's sample is the cheapest to build: Mixtral's 32 layers of 8 experts.
@pytest.mark.sampled(1)
@pytest.mark.parametrize("spec", sorted(OLDER, key=lambda spec: spec != "mixtral"))
def test_older_presets_have_transformers_parameter_count(devices, spec):
  """The older presets at their published size (moejax.models.published: Mixtral-8x7B, Qwen1.5-MoE, Qwen3-Next,
  DeepSeek-V3), counted from the abstract state and by the memory planner: transformers' count of the same model.
  DeepSeek-V3 without its MTP module, which transformers does not build."""
  entry = OLDER[spec]
  assert COUNTS[entry]["checkpoint"] == PUBLISHED[entry].source  # the same model on both sides
  config = decoder.get_config(f"{spec},published")
  config.model.num_mtp_layers = 0
  model_cfg, moe_cfg = config_lib.validate(config)[:2]
  counted = abstract_count(model_cfg, moe_cfg, mesh_lib.make_mesh(1, 4))
  planned = memory.analytic_state(model_cfg, moe_cfg, config.mesh.nodes, config.mesh.gpus_per_node)
  assert counted == planned["parameter_count"] == COUNTS[entry]["parameters"], (counted, planned["parameter_count"])


def _losses(config, steps: int) -> list:
  """The task loss of `steps` steps on one batch of random tokens, from random weights on the 2 x 4 mesh."""
  trainer = train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(2, 4), step_checks.TOK, donate=False)
  state_, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(2, 256, (1, 8, config.seq_len), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  losses = []
  for _ in range(steps):
    state_, metrics = trainer.step(state_, rest, batch)
    losses.append(float(metrics["task_loss"]))
  return losses


@pytest.mark.slow
@pytest.mark.parametrize("family", decoder.HF_SHAPED)
def test_tiny_trains_from_scratch_scanned_and_fsdp(devices, family):
  """Four steps of the tiny preset: the loss falls, and the run with its layers scanned and its parameters sharded
  (FSDP) has the plain run's losses."""
  config = decoder.get_config(family)
  config.update(batch_size=8, micro_batches=1, seq_len=16)
  config.optim.warmup_steps = 1
  plain = _losses(config, 4)
  assert np.isfinite(plain).all() and all(np.diff(plain) < 0) and plain[-1] < plain[0] - 0.1, plain
  config.model.update(scan_layers=True, fsdp=True)
  np.testing.assert_allclose(_losses(config, 4), plain, rtol=1e-5)


def test_unknown_spec_names_the_families():
  with pytest.raises(ValueError, match="deepseek_v4") as error:
    decoder.get_config("deepseek_v5")
  assert "'deepseek_v5'" in str(error.value) and "qwen3_moe" in str(error.value)
