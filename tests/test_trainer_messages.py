"""Two of the trainer's messages (issue 61), each one line naming the value and the fix: a branch that exists already
with another config (the refusal told someone who had passed checkpoint.resume=branch to pass it), and a corrupt
checkpoint skipped on resume (the warning embedded a pybind method's repr and the TensorStore spec, not the reason)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import checkpoint as checkpoints
from moejax import run_config
from moejax.train import resume
from moejax.validation import ConfigError
from tests.test_heldout import tiny_decoder_config


def _fake_run(directory, config):
  """A workdir as the trainer leaves it after a checkpoint at step 5 (its arrays are not read here)."""
  (directory / "checkpoints" / "5").mkdir(parents=True)
  stored = {**json.loads(run_config.dumps(config)), "versions": {}, "history": []}
  (directory / run_config.CONFIG_FILE).write_text(json.dumps(stored))


def test_a_branch_with_another_config_names_it_and_the_fixes_not_resume_branch(shared, tmp_path):
  run, branch = tmp_path / "q", tmp_path / "q_topk2"
  _fake_run(run, tiny_decoder_config(shared))
  branched = tiny_decoder_config(shared)
  branched.moe.top_k = 2
  branched.checkpoint.update(resume="branch", branch_dir=str(branch))
  _fake_run(branch, branched)  # the branch as its first run left it
  assert resume.prepare(branched, str(run), say=print) == (str(branch), None)  # the same command resumes it

  branched.optim.learning_rate = 0.1  # then another change, still with resume=branch
  with pytest.raises(ConfigError) as refused:
    resume.prepare(branched, str(run), say=print)
  message = str(refused.value)
  assert "\n" not in message and "resume=branch" not in message
  assert message.startswith(f"checkpoint.branch_dir {branch} holds a branch already, whose config differs")
  assert "optim.learning_rate 0.003 -> 0.1" in message and "moe.top_k" not in message  # the branch has top_k 2
  assert f"Branch {run} with this config into a new --config.checkpoint.branch_dir=DIR" in message
  assert f"--workdir={branch} --config.checkpoint.resume=continue --config.checkpoint.branch_dir=''" in message


def _truncate_largest_file(directory):
  files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
  largest = max(files, key=os.path.getsize)
  os.truncate(largest, os.path.getsize(largest) // 2)


def test_a_corrupt_checkpoint_is_skipped_with_its_step_path_and_error(mesh_2x4, tmp_path, capsys):
  sharded = NamedSharding(mesh_2x4, P(("node", "gpu")))
  # Large enough that its data is a file of its own (small arrays live inside the OCDBT b-tree's nodes).
  make = lambda i: {
    "w": jax.device_put(jnp.asarray(np.random.default_rng(i).normal(size=(512, 512)), jnp.float32), sharded)
  }
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), make(0))
  directory = tmp_path / "checkpoints"
  ckpt = checkpoints.Checkpointer(str(directory), keep=3, use_async=False)
  for step in (1, 2):
    ckpt.save(step, make(step), [[step]])
  ckpt.close()
  _truncate_largest_file(directory / "2" / "state")  # a copy cut short

  ckpt = checkpoints.Checkpointer(str(directory), keep=3, use_async=False)
  step, state, _ = ckpt.restore_latest(abstract)
  ckpt.close()
  assert step == 1
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(make(1)["w"]))
  [line] = [line for line in capsys.readouterr().out.splitlines() if "corrupt" in line]
  assert line.startswith(f"WARNING: checkpoint step 2 in {directory} is corrupt or incomplete (arrays: ValueError: ")
  assert line.endswith("); skipping it") and len(line) < 600
  for noise in ("bound method", "pybind", "TensorStore(", "tensorstore_spec"):
    assert noise not in line


def test_readable_gives_the_innermost_error_on_one_line():
  try:
    try:
      raise ValueError('OUT_OF_RANGE: Error reading "w/0.0" [tensorstore_spec=\'{"driver": "zarr"}\']\nmore')
    except ValueError as e:
      raise Exception("See full TensorStore details: <bound method pybind11_x.spec of TensorStore({...})>") from e
  except Exception as e:
    assert checkpoints.readable(e) == 'ValueError: OUT_OF_RANGE: Error reading "w/0.0"'
  assert checkpoints.readable(KeyError("meta")) == "KeyError: 'meta'"
