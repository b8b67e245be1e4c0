"""Resuming a pipelined run: tiny Qwen3-MoE with 2 stages (1f1b) on 2 x 1 x 4 devices trained 3 steps without a
stop, against 2 steps, then `train` again in the same workdir (restored from the step-2 checkpoint: the staged
parameters and their optimizer state split over 'stage', the data position) for the third. Every step's record and
the final state (parameters, optimizer state, step, RNG) are bit for bit the uninterrupted run's."""

import os

import jax
import numpy as np
import pytest

from configs import decoder
from moejax import checkpoint
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import metrics, objective
from moejax.train import trainer as train

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)


def _config(shared, steps: int):
  config = decoder.get_config("qwen3_moe")
  config.model.update(num_layers=2, moe_layers=(True, True))
  config.update(steps=steps, batch_size=16, micro_batches=4, seq_len=16)
  config.mesh.update(nodes=1, gpus_per_node=4)
  config.moe.update(num_nodes=1, collective="capacity", capacity_factor=4.0)
  config.pipeline.update(schedule="1f1b", stages=2)
  config.optim.update(warmup_steps=1, decay_steps=10)  # the schedule independent of `steps`
  config.data.update(cache_dir=str(shared / "cache"), tokenizer_train_chars=100_000, shards=4)
  config.checkpoint.update(every_steps=2, use_async=False)
  config.log.update(every_steps=1, tensorboard=False, eval_every=0)
  return config


def _final_state(config, workdir):
  """(step, state as NumPy arrays) of the newest checkpoint in `workdir`."""
  mesh = mesh_lib.make_mesh(1, 4, stages=2)
  abstract = train.Trainer(config, *config_lib.validate(config), mesh, TOK).abstract_state
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=3, use_async=False)
  try:
    step, state, _ = ckpt.restore_latest(abstract)
  finally:
    ckpt.close()
  return step, jax.tree.map(np.asarray, state)


@pytest.mark.slow  # three runs of a pipelined step (about 60 s on 2 cores)
def test_resumed_pipelined_run_is_bit_identical(devices, shared, tmp_path):
  whole, split = tmp_path / "whole", tmp_path / "split"
  train.train(_config(shared, 3), str(whole))
  train.train(_config(shared, 2), str(split))
  summary = train.train(_config(shared, 3), str(split))  # steps 2 -> 3: resumed without a word
  assert summary["resumed_from"] == 2
  got, want = (metrics.read_jsonl(str(d / "metrics.jsonl")) for d in (split, whole))
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
  for key in ("loss", "task_loss", "aux_loss", "grad_norm", "expert_load"):
    assert [r[key] for r in got] == [r[key] for r in want], key
  (step, state), (want_step, want_state) = (_final_state(_config(shared, 3), d) for d in (split, whole))
  assert step == want_step == 3
  jax.tree.map(np.testing.assert_array_equal, state, want_state)
