"""How fast `moejax.models.from_hf` loads a multi-shard Hugging Face checkpoint, and how much host memory it takes.

  python -m experiments.hf_load --workdir=/tmp/hf_load   # Qwen3-MoE-shaped, 4 layers, 64 experts: 1.7 GB fp32 (~1 min)
  python -m experiments.hf_load --workdir=/tmp/hf_load --config.layers=2 --config.experts=16 --config.keep=True
  python -m experiments.hf_load --workdir=/tmp/hf_load_fp8 --config.param_dtype=fp8   # the FP8 checkpoint's load

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
import shutil
import subprocess
import sys
import time

from absl import flags

from moejax import cli
from moejax.bench import host_memory
from moejax.bench.hf_load import MESH, PARAM_DTYPES, checkpoint_summary, derived, load, shapes, write
from moejax.validation import ConfigError, is_int, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD, CHECKPOINT = "hf_load.json", "checkpoint"
STAGES = ("all", "write", "load")


def stage(config, workdir: str, name: str) -> dict:
  """Runs this program's `name` stage in a fresh Python process (with this config's fields); returns the JSON it
  prints last."""
  cmd = [
    sys.executable,
    "-m",
    "experiments.hf_load",
    f"--workdir={workdir}",
    f"--config.stage={name}",
    *(f"--config.{k}={v}" for k, v in config.items() if k != "stage"),
  ]
  pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # `experiments` from anywhere
  proc = subprocess.run(
    cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath}
  )
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


def timed_loads(config, workdir: str, ckpt_dir: str) -> list[dict]:
  """The two loads, each in a process of its own: 'cold' after the files' pages were dropped, then 'warm'."""
  loads = []
  for cache in ("cold", "warm"):
    if cache == "cold":
      host_memory.drop_page_cache(ckpt_dir)
    cached = host_memory.cached_fraction(ckpt_dir)
    print(f"loading ({cache}: {cached:.0%} of the files' pages cached) ...", flush=True)
    run = stage(config, workdir, "load")
    run["derived"] = derived(run)
    loads.append({"cache": cache, "cached_fraction_before": cached, **run})
  return loads


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
  checkpoint, config_json = checkpoint_summary(ckpt_dir)
  loads = timed_loads(config, workdir, ckpt_dir)
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
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "hf_load.py"),
    "Benchmark config file (configs/hf_load.py).",
  )
  cli.define_workdir("Directory of the checkpoint and hf_load.json.")
  cli.run(main)
