"""A checkpoint's load timed (experiments/hf_load.py): a random Qwen3-MoE-shaped decoder, narrower, written with
`to_hf` and loaded with `from_hf` on a 2 x 4 mesh of simulated CPU devices, each in a process of its own; the load's
seconds and host memory (`host_memory`) and one expert weight checked against its tensor in the file."""

import json
import os
import shutil
import time

from moejax.bench.host_memory import Sampler, peak_rss, rss_status

MESH = (2, 4)
# param_dtype 'fp8': the checkpoint in DeepSeek's published FP8 (to_hf's fp8_blocks), loaded into bfloat16 parameters.
FP8_BLOCKS = (128, 128)
PARAM_DTYPES = ("float32", "bfloat16", "fp8")


def shapes(config) -> dict:
  """The DecoderConfig and MoEConfig fields of the benchmarked model (Qwen3-MoE's layout, narrower)."""
  model = dict(
    family="qwen3_moe",
    vocab_size=config.vocab,
    num_layers=config.layers,
    d_model=config.d_model,
    d_ff=3 * config.d_model,
    num_heads=config.heads,
    num_kv_heads=config.kv_heads,
    head_dim=config.head_dim,
    max_len=4096,
    moe_layers=(True,) * config.layers,
    rope_theta=1e6,
    qk_norm=True,
    dtype="float32",
    param_dtype=loaded_dtype(config),
  )
  moe = dict(
    num_experts=config.experts,
    top_k=config.top_k,
    d_model=config.d_model,
    d_ff=config.moe_d_ff,
    gated=True,
    activation="silu",
    renormalize=True,
    load_balance_coef=0.001,
  )
  return {"model": model, "moe": moe}


def loaded_dtype(config) -> str:
  """The parameters' dtype: config.param_dtype, bfloat16 for 'fp8' (its checkpoint's Linear weights in FP8 blocks)."""
  return "bfloat16" if config.param_dtype == "fp8" else config.param_dtype


def make_mesh():
  from moejax.runtime import mesh as mesh_lib

  mesh_lib.simulate_cpu_devices(MESH[0] * MESH[1])
  return mesh_lib.make_mesh(*MESH)


def write(config, ckpt_dir: str) -> dict:
  """Builds the random model and writes it with to_hf into `ckpt_dir` (run in a process of its own)."""
  mesh = make_mesh()
  import jax
  from flax import nnx

  from moejax import models
  from moejax.models import state as state_lib
  from moejax.models.decoder_config import DecoderConfig
  from moejax.moe.config import MoEConfig

  fields = shapes(config)
  cfg, moe_cfg = DecoderConfig(**fields["model"]), MoEConfig(**fields["moe"])
  start = time.perf_counter()
  graphdef, _, _ = state_lib.abstract_state(cfg, moe_cfg, mesh)
  params, rest = state_lib.init_state(cfg, moe_cfg, mesh, seed=config.seed)
  model = nnx.merge(graphdef, params, rest)
  jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
  built = time.perf_counter() - start
  if os.path.exists(ckpt_dir):
    shutil.rmtree(ckpt_dir)
  start = time.perf_counter()
  models.to_hf(
    model, ckpt_dir, shard_bytes=config.shard_mb << 20, fp8_blocks=FP8_BLOCKS if config.param_dtype == "fp8" else None
  )
  return {"build_s": built, "write_s": time.perf_counter() - start, "writer_peak_rss_bytes": peak_rss()}


def load(config, ckpt_dir: str) -> dict:
  """One timed from_hf of `ckpt_dir` in this (fresh) process."""
  mesh = make_mesh()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from moejax import models
  from moejax.models import hf_checkpoint, layers

  jax.block_until_ready(jax.device_put(jnp.zeros(8), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  baseline = {"peak_rss_bytes": peak_rss(), **{f"{k}_bytes": v for k, v in rss_status().items()}}
  with Sampler() as sampler:
    start = time.perf_counter()
    model = models.from_hf(ckpt_dir, mesh, dtype="float32", param_dtype=loaded_dtype(config))
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
  after = {"peak_rss_bytes": peak_rss(), **{f"{k}_bytes": v for k, v in rss_status().items()}}
  arrays = [a for a in leaves if isinstance(a, jax.Array)]
  model_bytes = sum(a.nbytes for a in arrays)
  resident = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
  # One expert weight checked against its tensor in the file, dequantised for 'fp8' (after the measurement).
  from moejax.models import hf_files

  name = hf_checkpoint.hf_key(("blocks", 0, "ffn", "moe", "w_in"), model.cfg)[0].format(e=config.experts - 1)
  shards = hf_files.Shards(ckpt_dir)
  want = np.asarray(shards.tensor(name)[...]).T
  shards.close()
  first = layers.per_layer(nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.cfg)[0]  # scanned or not
  got = np.asarray(first["ffn"]["moe"]["w_in"][config.experts - 1])
  return {
    "seconds": seconds,
    "baseline": baseline,
    "after": after,
    "sampled_peak": {f"{k}_bytes": v for k, v in sampler.peak.items()},
    "model_bytes": model_bytes,
    "resident_bytes": resident,
    "arrays": len(arrays),
    "check_tensor": name,
    "check_equal": bool(np.array_equal(want.astype(got.dtype), got)),
    "device": jax.devices()[0].device_kind,
    "platform": jax.devices()[0].platform,
    "device_count": jax.device_count(),
    "jax": jax.__version__,
  }


def checkpoint_summary(ckpt_dir: str) -> tuple[dict, dict]:
  """The written checkpoint: its safetensors files, tensors and bytes; and its config.json."""
  from safetensors import safe_open

  files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
  with open(os.path.join(ckpt_dir, "config.json")) as f:
    config_json = json.load(f)
  tensors = 0
  for file in files:
    with safe_open(os.path.join(ckpt_dir, file), framework="numpy") as f:
      tensors += len(list(f.keys()))
  summary = {
    "files": len(files),
    "tensors": tensors,
    "bytes": sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in files),
    "file_bytes": {f: os.path.getsize(os.path.join(ckpt_dir, f)) for f in files},
  }
  return summary, config_json


def derived(run: dict) -> dict:
  """A load's own memory beyond the model, and the checkpoint pages it kept mapped (bytes)."""
  base, sampled = run["baseline"], run["sampled_peak"]
  return {
    "anon_over_resident_bytes": sampled["RssAnon_bytes"] - base["RssAnon_bytes"] - run["resident_bytes"],
    "file_mapped_bytes": sampled["RssFile_bytes"] - base["RssFile_bytes"],
    "maxrss_delta_bytes": run["after"]["peak_rss_bytes"] - base["peak_rss_bytes"],
  }
