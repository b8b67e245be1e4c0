"""How fast `moejax.models.from_hf` loads a multi-shard Hugging Face checkpoint, and how much host memory it takes.

  python benchmarks/hf_load.py --workdir=/tmp/hf_load   # Qwen3-MoE-shaped, 4 layers, 64 experts: 1.7 GB fp32 (~1 min)
  python benchmarks/hf_load.py --workdir=/tmp/hf_load --config.layers=2 --config.experts=16 --config.keep=True
  python benchmarks/hf_load.py --workdir=/tmp/hf_load_fp8 --config.param_dtype=fp8   # the FP8 checkpoint's load

Every option is a field of configs/hf_load.py; the record is <workdir>/hf_load.json. A random Qwen3-MoE-shaped
decoder (moejax's own `Decoder`, `state.init_state` on a 2 x 4 mesh of simulated CPU devices) is written with `to_hf`
into <workdir>/checkpoint (replaced if it exists; removed afterwards unless config.keep) in safetensors shards of
config.shard_mb, in a process of its own. Then each load runs in a fresh process (nothing of the writer's memory or
compiled code in it): JAX started, the 2 x 4 mesh made and a first array placed (the baseline), then `from_hf` timed
until every array of the model is ready.
Memory: ru_maxrss (the process's peak resident set) before and after the load, and the peaks of /proc/self/status'
RssAnon (the process's own memory: the model's arrays, numpy temporaries) and RssFile (checkpoint pages mapped by
safetensors) sampled every few ms by a thread during the load. Two loads: 'cold' after the shard files' pages were
dropped from the page cache (posix_fadvise DONTNEED; what is still cached is not ours to drop) and 'warm' right
after it (the fraction of the files' pages cached before each load is recorded, from mincore).

On simulated CPU devices the devices' memory is host memory: the loaded model counts in the RSS. `model_bytes` is
its logical size (each array once) and `resident_bytes` what its shards take on all 8 devices (replicated arrays,
the dense layers and the routers, once per device). A loader that holds a host copy of the whole checkpoint while
placing it takes about resident_bytes + checkpoint_bytes of anonymous memory over its baseline; one that reads tensor
by tensor, block by block, about resident_bytes plus one tensor. safetensors reads through mmap, so the pages of a
file that has been read stay mapped, and counted in RssFile and ru_maxrss, while the file is open: clean page cache
the kernel can take back, but in the peak RSS all the same. The record's `derived` splits the two: anonymous memory
beyond resident_bytes, and the checkpoint bytes mapped at the peak.
"""

import json
import os
import platform as host_platform
import resource
import shutil
import subprocess
import sys
import threading
import time

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `moejax` importable from the tree
  sys.path.insert(0, ROOT)

from moejax import cli  # noqa: E402
from moejax.validation import ConfigError, is_int, require  # noqa: E402

MESH = (2, 4)
# param_dtype 'fp8': the checkpoint in DeepSeek's published FP8 (to_hf's fp8_blocks), loaded into bfloat16 parameters.
FP8_BLOCKS = (128, 128)
PARAM_DTYPES = ("float32", "bfloat16", "fp8")
RECORD, CHECKPOINT = "hf_load.json", "checkpoint"
STAGES = ("all", "write", "load")


def rss_status() -> dict:
  """Current RssAnon, RssFile and VmRSS of this process in bytes (Linux /proc)."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      key = line.split(":")[0]
      if key in ("RssAnon", "RssFile", "VmRSS"):
        out[key] = int(line.split()[1]) * 1024
  return out


def peak_rss() -> int:
  """ru_maxrss in bytes (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler:
  """Samples rss_status() every `interval` s on a thread; keeps the peak of each entry."""

  def __init__(self, interval: float = 0.005):
    self.interval, self.peak, self._stop = interval, rss_status(), threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      for key, value in rss_status().items():
        self.peak[key] = max(self.peak.get(key, 0), value)
      time.sleep(self.interval)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


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


def drop_page_cache(directory: str) -> None:
  """Asks the kernel to drop the files' clean pages from the page cache (no privileges needed)."""
  for name in os.listdir(directory):
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def cached_fraction(directory: str) -> float:
  """Fraction of the safetensors files' pages in the page cache (mincore over a read-only mapping)."""
  import ctypes
  import mmap

  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype, libc.mmap.argtypes = (
    ctypes.c_void_p,
    (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long),
  )
  libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
  libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
  cached = total = 0
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    size = os.path.getsize(path)
    if not name.endswith(".safetensors") or not size:
      continue
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
      address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
      vec = ctypes.create_string_buffer(pages)
      if libc.mincore(address, size, vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore {path}")
      libc.munmap(address, size)
    finally:
      os.close(fd)
    cached += sum(byte & 1 for byte in vec.raw[:pages])
    total += pages
  return cached / max(total, 1)


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


def stage(config, workdir: str, name: str) -> dict:
  """Runs this script's `name` stage in a fresh Python process (with this config's fields); returns the JSON it
  prints last."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    f"--workdir={workdir}",
    f"--config.stage={name}",
    *(f"--config.{k}={v}" for k, v in config.items() if k != "stage"),
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if proc.returncode:
    sys.stderr.write(proc.stderr)
    raise SystemExit(f"stage {name} failed (exit status {proc.returncode})")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def gb(b: float) -> str:
  return f"{b / 1e9:7.3f}"


def table(record: dict) -> str:
  ck = record["checkpoint"]
  lines = [
    f"checkpoint: {ck['bytes'] / 1e9:.3f} GB in {ck['files']} safetensors files (shards <= "
    f"{record['shard_mb']} MiB), {ck['tensors']} tensors; model {record['model_bytes'] / 1e9:.3f} GB logical, "
    f"{record['resident_bytes'] / 1e9:.3f} GB resident on the {record['device_count']} simulated CPU devices",
    "GB; maxrss = ru_maxrss (the peak so far) before and after from_hf; anon, file = RssAnon, RssFile before "
    "and their peaks sampled during from_hf",
    f"{'load':5s} {'seconds':>8s} {'GB/s':>6s} {'maxrss':>7s} {'->':>7s} {'delta':>7s}  {'anon':>7s} {'->':>7s} "
    f"{'delta':>7s}  {'file':>7s} {'->':>7s} {'delta':>7s}",
  ]
  for run in record["loads"]:
    base, peak, sampled = run["baseline"], run["after"]["peak_rss_bytes"], run["sampled_peak"]
    cols = [
      (base["peak_rss_bytes"], peak),
      (base["RssAnon_bytes"], sampled["RssAnon_bytes"]),
      (base["RssFile_bytes"], sampled["RssFile_bytes"]),
    ]
    lines.append(
      f"{run['cache']:5s} {run['seconds']:8.2f} {ck['bytes'] / run['seconds'] / 1e9:6.2f} "
      + "  ".join(f"{gb(a)} {gb(b)} {gb(b - a)}" for a, b in cols)
    )
  writer = gb(record["writer"]["writer_peak_rss_bytes"]).strip()
  lines.append(
    f"writer (build + to_hf, its own process): peak RSS {writer} GB, to_hf {record['writer']['write_s']:.1f} s"
  )
  for run in record["loads"]:
    d = run["derived"]
    anon = gb(d["anon_over_resident_bytes"]).strip()
    lines.append(
      f"{run['cache']}: anonymous memory beyond the model's resident bytes {anon} GB; checkpoint pages mapped at the peak {gb(d['file_mapped_bytes']).strip()} GB "
      f"({d['file_mapped_bytes'] / ck['bytes']:.0%} of the checkpoint)"
    )
  lines.append(f"resident + checkpoint = {gb(record['resident_bytes'] + ck['bytes']).strip()} GB")
  return "\n".join(lines)


def check(config) -> None:
  """A ConfigError naming the first field of `config` that cannot be benchmarked."""
  for name in (
    "layers",
    "d_model",
    "heads",
    "kv_heads",
    "head_dim",
    "experts",
    "top_k",
    "moe_d_ff",
    "vocab",
    "shard_mb",
  ):
    require(is_int(config[name]), name, config[name], "a positive int")
  require(config.param_dtype in PARAM_DTYPES, "param_dtype", config.param_dtype, f"one of {PARAM_DTYPES}")
  require(config.stage in STAGES, "stage", config.stage, f"one of {list(STAGES)}")


def benchmark(config, workdir: str) -> None:
  """The benchmark (or, in a stage's process, that stage): writes <workdir>/hf_load.json and prints its table."""
  check(config)
  os.makedirs(workdir, exist_ok=True)
  ckpt_dir = os.path.join(workdir, CHECKPOINT)
  if config.stage != "all":
    print(json.dumps(write(config, ckpt_dir) if config.stage == "write" else load(config, ckpt_dir)))
    return

  start = time.perf_counter()
  print(f"writing the checkpoint to {ckpt_dir} ...", flush=True)
  written = stage(config, workdir, "write")
  files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
  with open(os.path.join(ckpt_dir, "config.json")) as f:
    config_json = json.load(f)
  from safetensors import safe_open

  tensors = 0
  for file in files:
    with safe_open(os.path.join(ckpt_dir, file), framework="numpy") as f:
      tensors += len(list(f.keys()))
  checkpoint = {
    "files": len(files),
    "tensors": tensors,
    "bytes": sum(os.path.getsize(os.path.join(ckpt_dir, f)) for f in files),
    "file_bytes": {f: os.path.getsize(os.path.join(ckpt_dir, f)) for f in files},
  }
  loads = []
  for cache in ("cold", "warm"):
    if cache == "cold":
      drop_page_cache(ckpt_dir)
    cached = cached_fraction(ckpt_dir)
    print(f"loading ({cache}: {cached:.0%} of the files' pages cached) ...", flush=True)
    run = stage(config, workdir, "load")
    base, sampled = run["baseline"], run["sampled_peak"]
    run["derived"] = {  # the load's own memory beyond the model, and the checkpoint pages it kept mapped
      "anon_over_resident_bytes": sampled["RssAnon_bytes"] - base["RssAnon_bytes"] - run["resident_bytes"],
      "file_mapped_bytes": sampled["RssFile_bytes"] - base["RssFile_bytes"],
      "maxrss_delta_bytes": run["after"]["peak_rss_bytes"] - base["peak_rss_bytes"],
    }
    loads.append({"cache": cache, "cached_fraction_before": cached, **run})
  first = loads[0]
  record = {
    "date": time.strftime("%Y-%m-%d"),
    "device": first["device"],
    "platform": first["platform"],
    "device_count": first["device_count"],
    "mesh": list(MESH),
    "jax": first["jax"],
    "python": host_platform.python_version(),
    "cpu_count": os.cpu_count(),
    "shapes": shapes(config),
    "config_json": config_json,
    "shard_mb": config.shard_mb,
    "checkpoint": checkpoint,
    "model_bytes": first["model_bytes"],
    "resident_bytes": first["resident_bytes"],
    "writer": written,
    "loads": [
      {k: v for k, v in run.items() if k not in ("device", "platform", "device_count", "jax")} for run in loads
    ],
    "cold_cache_note": "cold: the shard files' pages dropped with posix_fadvise(DONTNEED) before the load "
    "(best effort; the disk's and hypervisor's caches are not ours to drop)",
    "total_s": time.perf_counter() - start,
  }
  if not config.keep:
    shutil.rmtree(ckpt_dir)
  print(table(record))
  path = os.path.join(workdir, RECORD)
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {path} ({record['total_s']:.0f} s)")


def main(argv):
  del argv
  try:
    benchmark(flags.FLAGS.config, flags.FLAGS.workdir)
  except ConfigError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.define_config(os.path.join(ROOT, "configs", "hf_load.py"), "Benchmark config file (configs/hf_load.py).")
  cli.define_workdir("Directory of the checkpoint and hf_load.json.")
  cli.run(main)
