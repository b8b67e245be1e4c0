"""The decoder families through the pipeline: the trainer's step with pipeline.stages > 1 against the unpipelined
step on the same devices' ('node', 'gpu') mesh (fp32, fresh random tokens, three optimizer steps: every metric, the
first step's AdamW moment (1 - b1) x the gradient of every parameter, the parameters after three steps), and the
pipeline section's refusals naming their fields. The MoE layers exchange by all-to-all ('capacity', no drops): the
padded exchange is refused with a pipeline (`moejax.pipeline.section`)."""

import sys

import jax
import numpy as np
import pytest

from moejax.runtime import mesh as mesh_lib
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import trainer as train
from moejax.validation import ConfigError
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT))
from configs import decoder  # noqa: E402

TOK = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
MICRO = 4


def _config(spec: str, layers: int, nodes: int, gpus: int, pipeline=None, **moe):
  config = decoder.get_config(spec)
  dense = 1 if spec == "deepseek_v3" else 0
  per_layer = {  # the preset's patterns of layer kinds (mixers, sliding and NoPE layers) repeated over `layers`
    name: tuple(value[i % len(value)] for i in range(layers))
    for name, value in config.model.items()
    if isinstance(value, tuple) and len(value) == config.model.num_layers and all(type(v) in (bool, str) for v in value)
  }
  config.model.update(per_layer, num_layers=layers, moe_layers=tuple(i >= dense for i in range(layers)))
  config.update(batch_size=MICRO * nodes * gpus, micro_batches=MICRO, seq_len=16)
  config.mesh.update(nodes=nodes, gpus_per_node=gpus)
  config.moe.update(num_nodes=nodes, collective="capacity", capacity_factor=4.0, **moe)  # nothing dropped
  config.data.shards = nodes * gpus
  config.optim.warmup_steps = 1
  if pipeline:
    config.pipeline.update(pipeline)
  return config


def _three_steps(config, stages: int, tokens):
  trainer = train.Trainer(
    config,
    *config_lib.validate(config),
    mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node, stages=stages),
    TOK,
    donate=False,
  )
  state, rest = trainer.init()
  records = []
  for i, batch in enumerate(tokens):
    state, metrics = trainer.step(state, rest, jax.device_put(batch, trainer.batch_sharding))
    records.append(jax.device_get(metrics))
    if i == 0:
      first_moment = jax.device_get(state["opt_state"])
  return records, jax.device_get(state["params"]), first_moment


_UNPIPELINED = {}  # the unpipelined run of each (spec, layers, nodes, gpus, moe, tokens' seed): several cases share one


def _unpipelined(spec, layers, nodes, gpus, moe, seed, tokens):
  key = (spec, layers, nodes, gpus, tuple(sorted(moe.items())), seed)
  if key not in _UNPIPELINED:
    _UNPIPELINED[key] = _three_steps(_config(spec, layers, nodes, gpus, **moe), 1, tokens)
  return _UNPIPELINED[key]


def _case(spec, layers, schedule, stages, virtual, nodes, gpus, moe):
  """A case, in the xdist group of its unpipelined run (seeded by stages and layers), so the cases sharing it share
  a worker."""
  group = f"unpipelined-{spec}-{layers}-{nodes}x{gpus}-{sorted(moe)}-{stages * 10 + layers}"
  return pytest.param(spec, layers, schedule, stages, virtual, nodes, gpus, moe, marks=pytest.mark.xdist_group(group))


@pytest.mark.slow
@pytest.mark.parametrize(
  "spec,layers,schedule,stages,virtual,nodes,gpus,moe",
  [
    _case("qwen3_moe", 2, "1f1b", 2, 1, 1, 4, {}),
    _case("deepseek_v3", 3, "gpipe", 2, 1, 1, 4, {}),
    _case("deepseek_v3", 5, "1f1b", 4, 1, 1, 2, {}),
    _case("qwen3_moe", 4, "gpipe", 4, 1, 2, 1, {}),
    _case("deepseek_v3", 5, "1f1b", 2, 1, 1, 4, dict(balance_loss="global_batch", load_balance_coef=0.1)),
    _case("qwen3_moe", 4, "dualpipev", 2, 1, 1, 4, {}),
    _case("qwen3_moe", 2, "dualpipe", 2, 1, 1, 4, {}),
    _case("deepseek_v3", 5, "dualpipev", 2, 1, 1, 4, dict(balance_loss="global_batch", load_balance_coef=0.1)),
    _case("qwen3_moe", 4, "interleaved", 2, 2, 1, 4, {}),
    _case("qwen3_next", 8, "1f1b", 2, 1, 1, 4, {}),
    # The 2026 mixers and blocks (configs/decoder.py's tiny presets): KDA beside NoPE MLA, Qwen3.5's gated DeltaNet,
    # DSA's indexer, LongCat-Flash's ScMoE layers, MiMo-V2-Flash's sliding layers with sinks.
    _case("kimi_linear", 8, "1f1b", 2, 1, 1, 4, {}),
    _case("qwen3_5_moe", 8, "1f1b", 2, 1, 1, 4, {}),
    _case("deepseek_v32", 4, "1f1b", 2, 1, 1, 4, {}),
    _case("longcat_flash", 2, "1f1b", 2, 1, 1, 4, {}),
    _case("mimo_v2_flash", 16, "1f1b", 2, 1, 1, 4, {}),
  ],
)
def test_pipelined_step_equals_the_unpipelined(devices, spec, layers, schedule, stages, virtual, nodes, gpus, moe):
  """DeepSeek-V3: its dense first layer on the first stage, its MTP module (an MoE block) on the last. With
  balance_loss='global_batch' each micro-batch's balance loss counts the step's earlier micro-batches' choices, in
  every layer and the MTP module: each stage carries its own layers' (1F1B: a stage's backward of micro-batch i after
  its forwards of later ones). dualpipev: 4 stages of layers on 2 devices, the V; dualpipe: each stage on both
  devices, its gradients the two copies' sum; interleaved (virtual_stages 2): 4 stages of layers on 2 devices,
  device d running stages d and d + 2, each micro-batch passing the devices twice. The 2026 presets repeat their
  pattern of layer kinds: a stage runs one program, so each holds two repeats or more of it (MiMo-V2-Flash's full,
  sliding, sliding, full: 16 layers)."""
  seed = stages * 10 + layers
  tokens = np.random.default_rng(seed).integers(TOK.first_ordinary, TOK.num_ids, (3, MICRO, nodes * gpus, 16), np.int32)
  pipeline = dict(schedule=schedule, stages=stages, virtual_stages=virtual)
  piped = _three_steps(_config(spec, layers, nodes, gpus, pipeline, **moe), stages, tokens)
  plain = _unpipelined(spec, layers, nodes, gpus, moe, seed, tokens)
  for step, (got, want) in enumerate(zip(piped[0], plain[0])):
    assert set(got) == set(want)
    for name in want:
      # The first step's every metric; after an update, fp32 rounding may flip a near-tied routing choice: the
      # losses then differ in their fifth digit and the counts by a few.
      exact = step == 0 or name not in (
        "expert_counts",
        "loss",
        "task_loss",
        "aux_loss",
        "mtp_loss",
        "accuracy",
        "grad_norm",
        "expert_bias_range",
      )
      got_np, want_np = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
      if name == "expert_counts" and not exact:
        # Every choice is counted either way; a choice flipped in one step moves the next update, which can flip a
        # few more: 3 in one of 64 counts by the third step after a fresh install (2026-12-01; 1 before).
        np.testing.assert_array_equal(got_np.sum(-1), want_np.sum(-1), err_msg=f"{step} {name} per layer")
        np.testing.assert_allclose(got_np, want_np, atol=4.0, err_msg=f"{step} {name}")
        continue
      np.testing.assert_allclose(
        got_np, want_np, rtol=2e-5 if exact else 1e-3, atol=1e-6 if exact else 2.0, err_msg=f"{step} {name}"
      )
  for got, want in zip(jax.tree.leaves(piped[2]), jax.tree.leaves(plain[2])):  # (1 - b1) x every gradient
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-4, atol=1e-7)
  # After three AdamW steps: its update divides by the gradient's own scale, so where an element's gradient is a
  # near-cancelling sum fp32 rounding can turn that element's update around, each step by up to twice the learning
  # rate (seen: 3e-4 in one embedding; 7.8e-3 in 2% of one after a fresh install on 2026-12-01), and a routing
  # choice flipped in an earlier step gives an expert other rows (6% of an expert weight's elements past 1e-3, the
  # same install). A stage whose update went wrong moves most elements of its leaves.
  rate = _config(spec, layers, nodes, gpus).optim.learning_rate
  for got, want in zip(jax.tree.leaves(piped[1]), jax.tree.leaves(plain[1])):
    moved = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert moved.max() <= 3 * 2 * rate, (moved.max(), rate)
    assert np.mean(moved > 1e-3) <= 0.25, np.mean(moved > 1e-3)


@pytest.mark.parametrize(
  "update,field",
  [
    (dict(pipeline=dict(schedule="interleaved", stages=2)), "pipeline.virtual_stages"),  # v = 1: no chunks
    (
      dict(pipeline=dict(schedule="interleaved", stages=2, virtual_stages=2)),
      "pipeline.virtual_stages",
    ),  # 2 MoE layers over 4 stages (2 devices alone would split them)
    (dict(pipeline=dict(schedule="interleaved", stages=4, virtual_stages=2)), "pipeline.stages"),  # 2 over 4 devices
    (dict(pipeline=dict(schedule="interleaved", stages=2, virtual_stages=0)), "pipeline.virtual_stages"),
    (dict(pipeline=dict(schedule="interleaved", stages=2, virtual_stages=2.0)), "pipeline.virtual_stages"),
    (dict(pipeline=dict(schedule="1f1b", stages=2, virtual_stages=2)), "pipeline.virtual_stages"),
    (dict(pipeline=dict(schedule="none", stages=1, virtual_stages=2)), "pipeline.virtual_stages"),
    (dict(pipeline=dict(schedule="two_batch", stages=1, virtual_stages=2)), "pipeline.virtual_stages"),
    (dict(pipeline=dict(schedule="dualpipev", stages=4)), "micro_batches"),  # 8 stages of layers need 8
    (dict(pipeline=dict(schedule="dualpipev", stages=2)), "pipeline.stages"),  # 2 MoE layers over 4 stages
    (dict(pipeline=dict(schedule="dualpipe", stages=2), moe=dict(balance_loss="global_batch")), "moe.balance_loss"),
    (dict(pipeline=dict(schedule="1f1b", stages=1)), "pipeline.stages"),
    (dict(pipeline=dict(schedule="none", stages=2)), "pipeline.stages"),
    (dict(pipeline=dict(schedule="1f1b", stages=4)), "pipeline.stages"),  # 2 MoE layers over 4 stages
    (dict(pipeline=dict(schedule="1f1b", stages=2), model=dict(scan_layers=False)), "model.scan_layers"),
    (dict(pipeline=dict(schedule="1f1b", stages=2), moe=dict(collective="padded")), "moe.collective"),
    (dict(pipeline=dict(schedule="1f1b", stagez=2)), "pipeline.stagez"),
    (dict(pipeline=dict(schedule="1f1b", stages=2, virtual_stagez=1)), "pipeline.virtual_stagez"),
  ],
)
def test_pipeline_refusals_name_the_field(update, field):
  config = _config("deepseek_v3", 3, 1, 4)
  for section, fields in update.items():
    if section == "pipeline":
      config.pipeline = {"virtual_stages": 1, **fields}
    else:
      config[section].update(fields)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    config_lib.validate(config)
