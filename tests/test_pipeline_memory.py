"""A device's memory stays flat as stages are added: the trainer's compiled 1F1B step (XLA's memory analysis of the
SPMD program, per device) on tiny Qwen3-MoE with 2 layers a stage, at 2 stages (4 layers, 2 x 1 x 2 devices) and 4
stages (8 layers, 4 x 1 x 2), the same micro-batches and tokens per stage. Its arguments (the state: a stage's
layers, the replicated embeddings and head, their optimizer state; the batch) are equal, its temporaries within 2%
(1F1B's buffers hold p stage inputs, one micro-batch's [B, S, D] each, 4 KB here: the only term that grows with p;
the layers' own activations are rematerialised in each backward)."""

import jax
import jax.numpy as jnp
import pytest

from configs import decoder
from moejax.models import state as state_lib
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
LAYERS_PER_STAGE, MICRO, GPUS = 2, 4, 2


def step_memory(stages: int, schedule: str = "1f1b", layers: int | None = None):
  """The compiled pipelined step's `memory_analysis()` with `stages` x LAYERS_PER_STAGE layers (or `layers`) on
  stages x 1 x GPUS devices (batch [MICRO, GPUS, 16] tokens: 1 row a device per micro-batch); schedule 'none' and
  stages 1: the unpipelined step."""
  layers = layers or LAYERS_PER_STAGE * stages
  config = decoder.get_config("qwen3_moe")
  config.model.update(num_layers=layers, moe_layers=(True,) * layers)
  config.update(batch_size=MICRO * GPUS, micro_batches=MICRO, seq_len=16)
  config.mesh.update(nodes=1, gpus_per_node=GPUS)
  config.moe.update(num_nodes=1, collective="capacity", capacity_factor=4.0)
  config.data.shards = GPUS
  config.pipeline.update(schedule=schedule, stages=stages)
  model_cfg, moe_cfg = config_lib.validate(config)
  mesh = mesh_lib.make_mesh(1, GPUS, stages=stages)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh, TOK, donate=False)
  _, _, rest = state_lib.abstract_state(model_cfg, moe_cfg, mesh, config.seed)
  batch = jax.ShapeDtypeStruct((MICRO, MICRO * GPUS // MICRO, 16), jnp.int32, sharding=trainer.batch_sharding)
  return trainer.step.lower(trainer.abstract_state, rest, batch).compile().memory_analysis()


@pytest.mark.slow  # three compiled steps (about 30 s on 2 cores)
def test_memory_per_device_is_flat_as_stages_are_added(devices):
  """Against the unpipelined step of the 4-stage model's 8 layers on 1 x 2 devices, whose arguments hold them all."""
  two, four = step_memory(2), step_memory(4)
  plain = step_memory(1, "none", layers=4 * LAYERS_PER_STAGE)
  print(
    "argument, temp bytes per device at 2 and 4 stages, unpipelined:",
    *((m.argument_size_in_bytes, m.temp_size_in_bytes) for m in (two, four, plain)),
  )
  assert four.argument_size_in_bytes == two.argument_size_in_bytes < 0.6 * plain.argument_size_in_bytes
  total = lambda m: m.argument_size_in_bytes + m.temp_size_in_bytes
  assert abs(total(four) - total(two)) <= 0.02 * total(two)
  assert abs(four.temp_size_in_bytes - two.temp_size_in_bytes) <= 0.02 * two.temp_size_in_bytes


def _tiny_deepseek(**model):
  """Tiny DeepSeek-V3 (1 dense, 2 MoE layers, its MTP module) on 2 x 4 devices, one 32-token row a device."""
  config = decoder.get_config("deepseek_v3")
  config.update(batch_size=8, micro_batches=1, seq_len=32)
  config.model.update(model)
  return config_lib.validate(config)


def _state_bytes_by_part(model_cfg, moe_cfg, mesh) -> dict:
  """Per-device parameter bytes of the model's own leaves (their shardings), by where a pipeline puts them: the
  token embeddings, the layers (blocks or stacked segments), the rest (final norm, head, MTP modules)."""
  from moejax.study import memory as memory_lib

  _, params, _ = state_lib.abstract_state(model_cfg, moe_cfg, mesh, 0)
  parts = {"embeddings": 0, "layers": 0, "head": 0}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    top = str(getattr(path[0], "key", path[0]))
    part = "embeddings" if top == "embed" else "layers" if top in ("segments", "blocks") else "head"
    parts[part] += memory_lib.shard_bytes(leaf)
  return parts


@pytest.mark.parametrize(
  "schedule,stages,micro,virtual",
  [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("dualpipe", 4, 8, 1), ("dualpipev", 4, 4, 1)],
)
def test_pipelined_count_is_the_per_device_formula(devices, schedule, stages, micro, virtual):
  """The planner's pipelined count (`study.memory_rows.pipeline_count`) of the last stage (the busier: the head, the MTP
  module, the loss), against the formula applied to the model's own leaves (fp32, no remat, no FSDP): parameters
  parameter_stages x layers_fraction x the layers' + the rest; activations activation_stages x layers_fraction x
  (dense x a dense block's + MoE x an MoE block's) + the MTP block's + the head's loss."""
  from moejax.pipeline import memory as pipeline_memory
  from moejax.study import memory as memory_lib
  from moejax.study import memory_rows

  model_cfg, moe_cfg = _tiny_deepseek()
  mesh = mesh_lib.make_mesh(2, 4)
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh, 8 * 32)
  per = pipeline_memory.per_device(schedule, stages, micro, virtual)
  count = memory_rows.pipeline_count(model_cfg, moe_cfg, 2, 4, None, 1, 32, exchange, 0, per)
  parts = _state_bytes_by_part(model_cfg, moe_cfg, mesh)
  assert count["stage"] == "last"
  assert count["parameters"] == per["parameter_stages"] / stages * parts["layers"] + parts["head"]
  assert count["gradients"] == count["parameters"]  # float32 parameters, float32 gradients
  acts = memory_lib.analytic_activations(model_cfg, moe_cfg, 1, 32, exchange, 0)
  blocks = acts["per_dense_block"] + 2 * acts["per_moe_block"]
  want = per["activation_stages"] / stages * blocks + acts["per_moe_block"] + acts["head"]
  assert count["activations"] == pytest.approx(want, rel=1e-12)
  assert count["exchange_buffers"] == exchange["bytes"]
  assert count["stage_totals"]["first"] < count["total"]


@pytest.mark.slow  # one compiled step (about 10 s on 2 cores)
def test_pipelined_count_holds_the_compiled_arguments(devices):
  """The trainer's compiled 1F1B step (2 stages x 1 x 2 devices, tiny Qwen3-MoE, 4 layers): its arguments per
  device are the planner's last-stage parameters and optimizer state (AdamW's two fp32 moments), plus the token
  embeddings' (the step keeps them on every stage, replicated over 'stage'), the batch and the step's scalars."""
  from moejax.pipeline import memory as pipeline_memory
  from moejax.study import memory as memory_lib
  from moejax.study import memory_rows

  config = decoder.get_config("qwen3_moe")
  config.model.update(num_layers=4, moe_layers=(True,) * 4)
  config.moe.update(num_nodes=1)
  model_cfg, moe_cfg = config_lib.validate(config)
  per = pipeline_memory.per_device("1f1b", 2, MICRO)
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh_lib.make_mesh(1, GPUS), GPUS * 16)
  count = memory_rows.pipeline_count(model_cfg, moe_cfg, 1, GPUS, config.optim, 1, 16, exchange, 0, per)
  embeddings = memory_lib.analytic_state(model_cfg, moe_cfg, 1, GPUS, config.optim, parts=("embeddings",))
  compiled = step_memory(2).argument_size_in_bytes
  batch = MICRO * 16 * 4  # int32 tokens, one row a device per micro-batch
  scalars = compiled - (
    count["parameters"] + count["optimizer"] + embeddings["parameters"] + embeddings["optimizer"] + batch
  )
  print("compiled arguments", compiled, "analytic", compiled - scalars)
  assert 0 <= scalars <= 64  # the step, the key, AdamW's count
