"""The memory planner (experiments/memory.py) on tiny configs on the 2 x 4 mesh: the layer-scaled compile against the
whole model's, parameter and optimizer bytes against a count from the shapes, FSDP's saving, and the verdict."""

import dataclasses
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax.models import lm_loss
from moejax.models import state as state_lib
from moejax.runtime import mesh as mesh_lib
from moejax.study import memory as memory_lib
from moejax.study import memory_blocks
from moejax.train import config as config_lib
from moejax.train import objective
from moejax.train import optim as optim_lib
from moejax.train import trainer as train
from tests.helpers import ROOT, cpu_env

sys.path.insert(0, str(ROOT))
from configs import decoder, mlm  # noqa: E402
from experiments import memory  # noqa: E402

pytestmark = pytest.mark.xdist_group("memory_planner")


def _config(family, **model):
  config = mlm.get_config() if family is None else decoder.get_config(family)
  config.update(batch_size=8, micro_batches=1, seq_len=32)
  config.model.update(model)
  return config


def _deepseek(**model):
  """Tiny DeepSeek-V3 with 1 dense and 4 MoE blocks (and its MTP module), unrolled unless `model` says: the variants
  (1,1), (2,1), (1,2) must extrapolate to (1,4)."""
  return _config(
    "deepseek_v3", num_layers=5, moe_layers=(False, True, True, True, True), **{"scan_layers": False, **model}
  )


@pytest.fixture(scope="module")
def memory_plans(devices):
  return {
    "scaled": memory.plan(_deepseek()),
    "whole": memory.plan(_deepseek(), whole=True),
    "scanned": memory.plan(_deepseek(scan_layers=True)),
  }


@pytest.mark.parametrize("moment_dtype", [None, "bfloat16"])
def test_float32_tensors_of_a_bf16_model(devices, moment_dtype):
  """DeepSeek-V4 with bf16 parameters keeps its norms, sinks and mHC tensors in float32 (as transformers does): the
  analytic bytes of the parameters and the optimizer (moments in the parameters' dtype, or bf16) equal the state's."""
  config = _config("deepseek_v4", param_dtype="bfloat16")
  config.optim.update(name="adamw", master_dtype=None, moment_dtype=moment_dtype)
  config, model_cfg, moe_cfg = config_lib.checked(config)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  state = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), tok).abstract_state
  analytic = memory_lib.analytic_state(model_cfg, moe_cfg, 2, 4, config.optim)
  dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(state["params"])}
  assert dtypes == {np.dtype("bfloat16"), np.dtype("float32")}  # both kinds present: the test can tell them apart
  assert analytic["parameters"] == _shape_count(state["params"])
  exact = sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(state["opt_state"]))
  assert 0 <= exact - analytic["optimizer"] <= 64, (exact, analytic)


@pytest.mark.slow  # compiles the tiny model four times (about 25 s)
def test_layer_scaling_matches_the_whole_compile(memory_plans):
  """The compiled temp and total of the whole tiny model agree with those scaled from the three variants within 3%,
  and the scaled argument bytes with the exact state; the variants really are smaller models."""
  scaled, whole = memory_plans["scaled"], memory_plans["whole"]
  assert [(v["dense"], v["moe"]) for v in scaled["variants"]] == [(1, 1), (2, 1), (1, 2)]
  assert [(v["dense"], v["moe"]) for v in whole["variants"]] == [(1, 4)]
  for key in ("argument", "temp"):
    assert scaled["scaling"][key]["value"] == pytest.approx(whole["variants"][0][key], rel=0.03), key
  assert scaled["compiled"]["total"] == pytest.approx(whole["compiled"]["total"], rel=0.03)
  assert scaled["argument_check"]["scaled"] == pytest.approx(
    scaled["argument_check"]["exact_state_and_batch"], rel=1e-3
  )
  assert max(v["temp"] for v in scaled["variants"]) < whole["variants"][0]["temp"]


@pytest.mark.slow  # compiles the tiny model five times (about 60 s, with the fixture's)
def test_a_scanned_model_compiles_whole(memory_plans):
  """A scanned model is compiled whole, not scaled from variants; its state is the unrolled model's."""
  scanned = memory_plans["scanned"]
  assert scanned["method"] == "whole model compiled" and [(v["dense"], v["moe"]) for v in scanned["variants"]] == [
    (1, 4)
  ]
  for key in ("parameters", "optimizer", "gradients"):
    assert scanned["compiled"][key] == memory_plans["whole"]["compiled"][key], key


def _spec_devices(leaf) -> int:
  """Devices a leaf is split over, from its PartitionSpec's axis names alone."""
  sizes = dict(leaf.sharding.mesh.shape)
  names = [a for entry in leaf.sharding.spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))]
  return math.prod(sizes[a] for a in names)


def _shape_count(params) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize // _spec_devices(x) for x in jax.tree.leaves(params))


# The 2026 families' mixers and blocks: DeepSeek-V4 (its attention, mHC), LongCat-Flash (ScMoE), Qwen3.5 (gated
# DeltaNet, gated attention), Kimi Linear (KDA), GLM-5 (DSA), MiMo-V2-Flash (sliding layers' own heads, sinks).
NEW_MIXERS = ("deepseek_v4", "longcat_flash", "qwen3_5_moe", "kimi_linear", "glm_moe_dsa", "mimo_v2_flash")


@pytest.mark.parametrize(
  "family, qk_norm_mode",
  [(f, "head") for f in ("deepseek_v3", "qwen2_moe", "mixtral", None, *NEW_MIXERS)] + [("qwen2_moe", "projection")],
)
@pytest.mark.parametrize("fsdp", [False, True])
def test_state_bytes_equal_a_count_from_the_shapes(devices, family, fsdp, qk_norm_mode):
  """Parameter bytes per device from the shardings and from the config's dimensions (the analytic count) both equal
  a count from the parameters' shapes and specs; LAMB's states are two moments of each (and its step counts). The
  decoders' q/k norms per head and over the whole projections (OLMoE, MiniMax-M2)."""
  model = dict(fsdp=fsdp) if qk_norm_mode == "head" else dict(fsdp=fsdp, qk_norm=True, qk_norm_mode="projection")
  config, model_cfg, moe_cfg = config_lib.checked(_config(family, **model))
  mesh = mesh_lib.make_mesh(2, 4)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  state = train.Trainer(config, model_cfg, moe_cfg, mesh, tok).abstract_state
  want = _shape_count(state["params"])
  assert sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(state["params"])) == want
  analytic = memory_lib.analytic_state(model_cfg, moe_cfg, 2, 4)
  assert analytic["parameters"] == want and analytic["gradients"] == want
  optimizer = sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(state["opt_state"]))
  assert 0 <= optimizer - 2 * want <= 16 and analytic["optimizer"] == 2 * want


@pytest.mark.parametrize(
  "family,fsdp,optim",
  [
    ("deepseek_v3", True, dict(name="adamw", master_dtype="float32", moment_dtype="bfloat16")),
    ("deepseek_v3", False, dict(name="lamb", master_dtype=None, moment_dtype=None)),
    ("qwen2_moe", True, dict(name="muon", master_dtype="float32", moment_dtype=None)),
    ("deepseek_v3", False, dict(name="muon", master_dtype=None, moment_dtype="bfloat16")),
  ],
)
def test_analytic_optimizer_counts_master_and_moments(devices, family, fsdp, optim):
  """bf16 parameters: the analytic count's optimizer bytes (the fp32 master copy, the moments in their dtype, one
  of each matrix Muon orthogonalises and two of the rest) equal the abstract state's to its step counts; the
  master is twice the bf16 parameters, and so are the gradients (accumulated in float32)."""
  if optim["name"] == "muon" and not optim_lib.has_muon():
    pytest.skip(f"optim.name='muon' needs optax >= {optim_lib.MUON_OPTAX}")
  config = _config(family, fsdp=fsdp, param_dtype="bfloat16")
  config.optim.update(optim)
  config, model_cfg, moe_cfg = config_lib.checked(config)
  tok = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=254, num_ids=256)
  state = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4), tok).abstract_state
  exact = sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(state["opt_state"]))
  analytic = memory_lib.analytic_state(model_cfg, moe_cfg, 2, 4, config.optim)
  params = analytic["parameters"]
  assert params == _shape_count(state["params"]) and analytic["gradients"] == 2 * params
  assert analytic["master_weights"] == (2 * params if optim["master_dtype"] else 0)
  assert 0 <= exact - analytic["optimizer"] <= 64, (exact, analytic)
  assert analytic["optimizer"] == analytic["master_weights"] + analytic["moments"]


@pytest.mark.slow  # compiles the tiny model four times (about 25 s)
def test_planner_rows_hold_the_exact_state(memory_plans):
  """The planner's parameter and optimizer bytes are the abstract state's, equal to the analytic count."""
  for row in memory_plans.values():
    assert row["compiled"]["parameters"] == row["analytic"]["parameters"] > 0
    assert 0 <= row["compiled"]["optimizer"] - 2 * row["compiled"]["parameters"] <= 16
    assert row["compiled"]["gradients"] == row["compiled"]["parameters"]


@pytest.mark.slow  # compiles the tiny model four times (about 25 s)
def test_fsdp_saves_seven_eighths_of_the_shardable_part(memory_plans, devices):
  """FSDP's per-device parameter bytes fall below the replicated run's by 7/8 of the parameters that 8 devices can
  shard (a dimension divisible by 8; every parameter but the routed experts, which the MoE layer shards itself),
  counted here from the shapes."""
  config, model_cfg, moe_cfg = config_lib.checked(_deepseek())
  _, params, _ = state_lib.abstract_state(model_cfg, moe_cfg, mesh_lib.make_mesh(2, 4))
  shardable = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    routed = keys[-2:-1] == ["moe"] and keys[-1] in ("w_in", "w_out", "w_gate")
    if not routed and any(s % 8 == 0 for s in leaf.shape):
      shardable += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
  fsdp = memory_lib.analytic_state(*config_lib.validate(_deepseek(fsdp=True)), 2, 4)  # = the exact state (above)
  saved = memory_plans["whole"]["compiled"]["parameters"] - fsdp["parameters"]
  assert shardable > 0 and saved == shardable * 7 // 8
  assert fsdp["optimizer"] < memory_plans["whole"]["compiled"]["optimizer"]


@pytest.mark.slow  # compiles the tiny model four times (about 25 s)
def test_verdicts(memory_plans):
  """80 GB holds a tiny model."""
  assert (
    memory_plans["whole"]["verdict"] == memory_plans["whole"]["analytic_verdict"] == "fits"
  )  # "does not fit": test_command_line


@pytest.mark.slow
def test_command_line(tmp_path):
  """As its own process (it sets the device count itself): the table, the verdict and the JSON."""
  out = tmp_path / "memory.json"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.memory",
      "--config=configs/memory.py:decoder:qwen3_moe",
      "--config.micro_batches=1",
      "--config.planner.whole=True",
      "--config.planner.device_gb=0.0001",
      f"--workdir={tmp_path}",
    ],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "does not fit (compiled)" in result.stdout and "activations (derived)" in result.stdout
  row = json.loads(out.read_text())["rows"]["config"]
  assert row["verdict"] == "does not fit" and row["mesh"] == [2, 4] and row["method"] == "whole model compiled"


@pytest.mark.parametrize(
  "family,fields,want",
  [
    ("deepseek_v3", dict(dtype="bfloat16"), "cudnn"),  # MLA: q, k 24 wide, v padded to them
    ("deepseek_v3", dict(dtype="float32"), "xla"),  # cuDNN takes 16-bit inputs only
    ("qwen3_moe", dict(dtype="bfloat16", head_dim=12), "xla"),  # not a multiple of 8
    ("qwen3_moe", dict(dtype="bfloat16", head_dim=264), "xla"),  # wider than Hopper's 256
    ("qwen3_moe", dict(dtype="bfloat16", head_dim=256), "cudnn"),
    ("qwen3_moe", dict(dtype="float32", attention_impl="tokamax"), "tokamax"),  # as configured
    (None, dict(dtype="bfloat16"), "xla"),
  ],
)  # SMILE's blocks materialise their scores
def test_planned_attention(family, fields, want):
  cfg = dataclasses.replace(config_lib.validate(_config(family))[0], **fields)
  assert memory_blocks.planned_attention(cfg) == want


def test_fused_attention_keeps_no_scores(devices):
  """A fused attention keeps its log-sum-exp (B H S float32) where XLA's keeps the scores and probabilities
  (B H S^2 (4 + b)): the analytic activations differ by exactly that per block (remat='none': every block keeps its
  own), and by that only."""
  config, cfg, moe_cfg = config_lib.checked(_deepseek(dtype="bfloat16", remat="none"))
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh_lib.make_mesh(2, 4), 8 * 32)
  counts = {
    impl: memory_lib.analytic_activations(dataclasses.replace(cfg, attention_impl=impl), moe_cfg, 1, 32, exchange)
    for impl in ("xla", "cudnn")
  }
  assert counts["cudnn"]["attention"] == "cudnn"
  blocks = cfg.num_layers + cfg.num_mtp_layers
  per_block = cfg.num_heads * 32 * (32 * (4 + 2) - 4)
  assert counts["xla"]["activations"] - counts["cudnn"]["activations"] == blocks * per_block


@pytest.mark.parametrize("tokens,d,vocab,chunk", [(2048, 32, 8192, 0), (2048, 32, 8192, 700), (1024, 64, 16384, 2048)])
def test_loss_bytes_match_the_compiled_loss(tokens, d, vocab, chunk):
  """What `loss_bytes` counts for one head's loss equals, within 5%, the temporaries XLA compiles for
  `lm_loss.head_cross_entropy_sums` with its backward (the inputs, which the planner counts elsewhere, aside)."""
  spec = lambda *shape, dtype=jax.numpy.float32: jax.ShapeDtypeStruct(shape, dtype)
  loss = lambda h, k, t, w: lm_loss.head_cross_entropy_sums(h, k, None, t, w, chunk)[0]
  compiled = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    .lower(spec(1, tokens, d), spec(d, vocab), spec(1, tokens, dtype=jax.numpy.int32), spec(1, tokens))
    .compile()
  )
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp == pytest.approx(memory_blocks.loss_bytes(tokens, vocab, chunk), rel=0.05)


@pytest.mark.slow  # a process of 256 simulated devices (about 15 s)
def test_deepseek_v3_with_its_recipe_fits_80_gb():
  """The analytic count of DeepSeek-V3 on 32 x 8 with its recipe (configs/decoder.py's published: AdamW, fp32 master,
  bf16 moments, fp32 gradients), FSDP, remat='full', 'auto' attention (cuDNN's on a Hopper GPU) and the chunked loss:
  at most 80 GB a device; with XLA's attention and the logits whole, it does not fit."""
  script = """
import json, sys
from moejax.runtime import mesh as mesh_lib
mesh_lib.simulate_cpu_devices(256)
from experiments import memory
from moejax.study import memory as memory_lib
from moejax.train import config as config_lib
out = {}
for impl, chunk in (("auto", 8192), ("xla", 0)):
  config = memory.preset_config("deepseek_v3_fsdp_remat")
  config.model.attention_impl = impl
  config.loss_chunk = chunk
  full, cfg, moe_cfg = config_lib.checked(config)
  rows = full.batch_size // full.micro_batches
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh_lib.make_mesh(32, 8), rows * full.seq_len)
  state = memory_lib.analytic_state(cfg, moe_cfg, 32, 8, full.optim)
  acts = memory_lib.analytic_activations(cfg, moe_cfg, rows // 256, full.seq_len, exchange, chunk)
  out[impl] = dict(total=state["parameters"] + state["optimizer"] + state["gradients"] + acts["activations"]
                   + exchange["bytes"], attention=acts["attention"], master=state["master_weights"])
print(json.dumps(out))
"""
  result = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert out["auto"]["attention"] == "cudnn" and out["auto"]["master"] > 0
  assert out["auto"]["total"] <= 80 * memory_lib.GB < out["xla"]["total"]
