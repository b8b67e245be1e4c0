"""Models that do not fit one device: FSDP (ZeRO-3) of the dense parameters, gradients and optimizer states over
the data-parallel devices, rematerialisation of the blocks, and expert data parallelism in training, each against
the replicated (or single-device) run, on the 2 x 4 mesh."""

import re

import jax
import numpy as np
import pytest

from configs import decoder, mlm
from moejax import checkpoint as checkpoint_lib
from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
STEPS = 3


def _config(family: str | None, **model):
  if family is None:  # SMILE's GPT decoder, every other FFN an MoE layer
    config = mlm.get_config()
    config.model.kind = "gpt"
  else:
    config = decoder.get_config(family)
  config.update(batch_size=8, micro_batches=1, seq_len=32)
  config.model.update(model)
  return config


def _trainer(config, nodes=2, gpus=4):
  return train.Trainer(config, *config_lib.validate(config), mesh_lib.make_mesh(nodes, gpus), TOK, donate=False)


def _run(trainer, steps=STEPS):
  """Losses of `steps` steps on one fixed batch, the final state and the compiled step's memory analysis."""
  state, rest = trainer.init()
  tokens = np.random.default_rng(1).integers(TOK.first_ordinary, TOK.num_ids, (1, 8, 32), np.int32)
  batch = jax.device_put(tokens, trainer.batch_sharding)
  memory = trainer.step.lower(state, rest, batch).compile().memory_analysis()
  losses = []
  for _ in range(steps):
    state, metrics = trainer.step(state, rest, batch)
    losses.append(float(metrics["task_loss"]))
  return losses, state, memory


@pytest.fixture(scope="module")
def replicated(devices):
  return {family: _run(_trainer(_config(family))) for family in (None, "deepseek_v3")}


@pytest.mark.parametrize(
  "family,model",
  [
    (None, dict(fsdp=True)),
    ("deepseek_v3", dict(fsdp=True, grad_sync="prioritized", remat="full")),
    ("deepseek_v3", dict(fsdp=True, tensor_parallel=True)),
  ],
)
def test_fsdp_trains_as_the_replicated_run(replicated, family, model):
  """The same losses and parameters after 3 optimizer steps (SMILE's GPT and DeepSeek-V3 with its MTP module), with
  Lina's prioritised gradient sync and full remat, or beside tensor parallelism (FSDP over 'node'); the dense
  parameters really are sharded."""
  want_losses, want_state, _ = replicated[family]
  trainer = _trainer(_config(family, **model))
  losses, state, _ = _run(trainer)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(want_state["params"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
  embedding = state["params"]["embed"]["embedding"]
  over, devices = (mesh_lib.NODE, 2) if model.get("tensor_parallel") else (mesh_lib.AXES, 8)
  assert embedding.sharding.spec[0] == over and len(embedding.addressable_shards[0].data) == 256 // devices


def _dense_bytes(params) -> tuple[int, int]:
  """(bytes of the parameters a device holds replicated, of those 8 devices can shard): every leaf but the routed
  experts (which the MoE layer shards itself; its routers and shared experts count) with a dimension divisible by
  8, counted from the shapes alone."""
  total = sharded = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-2:-1] == ["moe"] and keys[-1] in ("w_in", "w_out", "w_gate"):
      continue
    total += leaf.nbytes
    sharded += leaf.nbytes if any(size % 8 == 0 for size in leaf.shape) else 0
  return total, sharded


@pytest.mark.parametrize("family", [None, "deepseek_v3"])
def test_fsdp_divides_the_dense_state_by_the_devices(replicated, family):
  """The compiled step's per-device argument bytes fall by exactly 7/8 of the shardable dense parameters, times 3
  (the parameters and LAMB's two moments), against the replicated run's."""
  _, state, memory = replicated[family]
  _, sharded = _dense_bytes(state["params"])
  _, _, fsdp_memory = _run(_trainer(_config(family, fsdp=True)), steps=0)
  assert sharded > 0
  assert memory.argument_size_in_bytes - fsdp_memory.argument_size_in_bytes == 3 * sharded * 7 // 8


def _collectives(family: str, remat: str) -> dict:
  trainer = _trainer(_config(family, remat=remat, num_layers=1, moe_layers=(True,)))  # one block: a quick compile
  state, rest = trainer.init()
  batch = jax.device_put(np.ones((1, 8, 32), np.int32), trainer.batch_sharding)
  text = trainer.step.lower(state, rest, batch).compile().as_text()
  return {op: len(re.findall(rf"= \S+ {op}\(", text)) for op in ("collective-permute", "dot")}


def test_remat_recomputes_what_it_does_not_keep(replicated):
  """'full' runs the forward's exchanges and matmuls again in the backward, 'save_exchanged' fewer exchanges than
  'full' (the rows it keeps), 'save_matmuls' fewer matmuls; 'save_exchanged' trains to the same losses ('full' does
  in test_fsdp_trains_as_the_replicated_run)."""
  want_losses = replicated["deepseek_v3"][0]
  counts = {remat: _collectives("qwen3_moe", remat) for remat in ("none", "full", "save_exchanged", "save_matmuls")}
  losses, _, _ = _run(_trainer(_config("deepseek_v3", remat="save_exchanged")))
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert (
    counts["full"]["collective-permute"]
    > counts["save_exchanged"]["collective-permute"]
    > counts["none"]["collective-permute"]
  ), counts
  assert counts["full"]["dot"] > counts["save_matmuls"]["dot"] > counts["none"]["dot"], counts
  assert counts["save_matmuls"]["collective-permute"] == counts["full"]["collective-permute"], counts


def test_fsdp_state_saves_and_restores_sharded(replicated, tmp_path):
  """An FSDP run's state (parameters and optimizer states sharded) saved and restored: bit-identical, each array
  with its FSDP sharding."""
  trainer = _trainer(_config(None, fsdp=True))
  _, state, _ = _run(trainer, steps=1)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), keep=1, use_async=False)
  ckpt.save(1, state, {"data": []})
  ckpt.close()
  step, restored, _ = checkpoint_lib.Checkpointer(str(tmp_path), keep=1, use_async=False).restore_latest(
    trainer.abstract_state
  )
  assert step == 1
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == want.sharding


def test_expert_data_parallel_trains_as_one_device(devices):
  """Experts over a node's 4 GPUs, replicated over the 2 nodes (gradients summed over them): 3 steps give the
  losses of the same model trained on one device."""
  edp = _config(None, num_layers=2)
  edp.moe.update(num_experts=4, expert_data_parallel=True, capacity_factor=None)  # drops would depend on the mesh
  one = _config(None, num_layers=2)
  one.update(mesh=dict(nodes=1, gpus_per_node=1))
  one.moe.update(num_experts=4, num_nodes=1, capacity_factor=None)
  want, _, _ = _run(_trainer(one, 1, 1))
  got, _, _ = _run(_trainer(edp))
  np.testing.assert_allclose(got, want, rtol=1e-5)
