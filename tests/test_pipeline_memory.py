"""A device's memory stays flat as stages are added: the trainer's compiled 1F1B step (XLA's memory analysis of the
SPMD program, per device) on tiny Qwen3-MoE with 2 layers a stage, at 2 stages (4 layers, 2 x 1 x 2 devices) and 4
stages (8 layers, 4 x 1 x 2), the same micro-batches and tokens per stage. Its arguments (the state: a stage's
layers, the replicated embeddings and head, their optimizer state; the batch) are equal, its temporaries within 2%
(1F1B's buffers hold p stage inputs, one micro-batch's [B, S, D] each, 4 KB here: the only term that grows with p;
the layers' own activations are rematerialised in each backward)."""

import jax
import jax.numpy as jnp
import pytest

from moejax.configs import decoder
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
  print("argument, temp bytes per device at 2 and 4 stages, unpipelined:", *(
      (m.argument_size_in_bytes, m.temp_size_in_bytes) for m in (two, four, plain)))
  assert four.argument_size_in_bytes == two.argument_size_in_bytes < 0.6 * plain.argument_size_in_bytes
  total = lambda m: m.argument_size_in_bytes + m.temp_size_in_bytes
  assert abs(total(four) - total(two)) <= 0.02 * total(two)
  assert abs(four.temp_size_in_bytes - two.temp_size_in_bytes) <= 0.02 * two.temp_size_in_bytes
