"""Re-tune the tile table of kernels.tuning on the GPU at hand.

For every (kernel, dtype, shape class) it times each candidate TileConfig on a representative
shape (balanced groups), keeps the fastest, prints a table, writes every timing to
<workdir>/tune_kernels.json and the Python `TABLE` entries for kernels/tuning.py to paste to
<workdir>/tune_kernels_table.txt:

  python -m experiments.tune_kernels --workdir=/tmp/tuned
  python -m experiments.tune_kernels --workdir=/tmp/tuned --config.smoke=True   # CPU

Every option is a field of configs/tune_kernels.py. The workdir is this program's (`moejax.workdir_guard`): another
program's is refused, and so is a rerun with another config (naming the field; the timings there are kept).

Candidates that fail to compile (e.g. too much shared memory) are recorded and skipped. The
default sweep (32 candidates x 4 kernels x 2 classes, bf16) takes roughly 10-20 minutes.
"""

import itertools
import json
import os
import statistics

import jax
import jax.numpy as jnp
from absl import flags

from kernels import ffn, tuning
from kernels import gmm as gmm_lib
from moejax import cli, workdir_guard
from moejax.bench.kernel_cases import MODELS
from moejax.validation import require

_MANY, _FEW = MODELS["mixtral_8x7b"], MODELS["qwen2_moe"]
# shape class -> (M, G, d, f): many rows per group (Mixtral's experts and width, f = d) or few (Qwen2-MoE's case).
SHAPES = {
  "many_rows": (8192, _MANY["experts"], _MANY["d"], _MANY["d"]),
  "few_rows": (8192, _FEW["experts"], _FEW["d"], _FEW["f"]),
}
SMOKE_SHAPES = {"many_rows": (64, 2, 32, 32), "few_rows": (64, 4, 32, 32)}
RECORD, TABLE = "tune_kernels.json", "tune_kernels_table.txt"
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def candidates(config) -> list[tuning.TileConfig]:
  """Every TileConfig of the config's TILE_FIELDS (two tiny ones with smoke)."""
  if config.smoke:
    return [tuning.TileConfig(16, 16, 16, 4, 1), tuning.TileConfig(32, 32, 32, 4, 1)]
  return [tuning.TileConfig(*values) for values in itertools.product(*(config[name] for name in TILE_FIELDS))]


def check(config) -> None:
  """A ConfigError naming the first field of `config` that cannot be tuned."""
  bad = [k for k in config.kernels if k not in tuning.KERNELS]
  require(not bad, "kernels", ",".join(config.kernels), f"a subset of {list(tuning.KERNELS)} ({bad} are not)")
  bad = [d for d in config.dtypes if d not in ("bfloat16", "float32")]
  require(not bad, "dtypes", ",".join(config.dtypes), f"a subset of [bfloat16, float32] ({bad} are not)")
  for name in TILE_FIELDS:
    require(config[name] and min(config[name]) > 0, name, config[name], "positive integers")


def kernel_call(kernel, shape, dtype, interpret):
  """fn(config) -> jitted call of `kernel` alone with those tiles, and its arguments."""
  m, g, d, f = shape
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (m, d), dtype)
  w_in = (d**-0.5 * jax.random.normal(keys[1], (g, d, f))).astype(dtype)
  w_out = (f**-0.5 * jax.random.normal(keys[2], (g, f, d))).astype(dtype)
  w_gate = (d**-0.5 * jax.random.normal(keys[3], (g, d, f))).astype(dtype)
  dy = jax.random.normal(keys[4], (m, d), dtype)
  gs = jnp.full((g,), m // g, jnp.int32)

  def opts(config):
    return ffn.Options("silu", config, interpret)

  calls = {
    "gmm": (lambda c: lambda x, w, gs: gmm_lib.gmm(x, w, gs, tiling=c, interpret=interpret), (x, w_in, gs)),
    "ffn_in": (lambda c: lambda x, w, wg, gs: ffn.hidden(x, w, wg, gs, opts(c)), (x, w_in, w_gate, gs)),
    "ffn_bwd": (
      lambda c: lambda dy, x, w, wo, wg, gs: ffn.hidden_backward(dy, x, w, wo, wg, gs, opts(c)),
      (dy, x, w_in, w_out, w_gate, gs),
    ),
    "tgmm": (lambda c: lambda x, dy, gs: gmm_lib.tgmm(x, dy, gs, tiling=c, interpret=interpret), (x, dy, gs)),
  }
  make, args = calls[kernel]
  return lambda config: jax.jit(make(config)), args


def tune(kernels, dtypes, shapes, configs, warmup, iters, interpret):
  """-> (best config per table key, every timing)."""
  best, records = {}, []
  for kernel, dtype, (shape_class, shape) in itertools.product(kernels, dtypes, shapes.items()):
    key = (kernel, tuning.dtype_class(dtype), shape_class)
    make, args = kernel_call(kernel, shape, jnp.dtype(dtype), interpret)
    for config in configs:
      record = dict(kernel=kernel, dtype=str(dtype), shape_class=shape_class, shape=shape, config=config.__dict__)
      try:
        times = tuning.time_call(make(config), args, warmup, iters)
        record.update(times_s=times, median_s=statistics.median(times))
      except Exception as e:  # pylint: disable=broad-except
        record["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      records.append(record)
      status = f"{record['median_s'] * 1e3:9.3f} ms" if "median_s" in record else record["error"][:70]
      print(f"{kernel:8s} {key[1]:5s} {shape_class:10s} {config}  {status}", flush=True)
      if "median_s" in record and (key not in best or record["median_s"] < best[key][1]):
        best[key] = (config, record["median_s"])
  return best, records


def table_source(device: str, best) -> str:
  """`best` as Python lines for the device's table in kernels/tuning.py."""
  lines = [f"# Tuned on {device}: kernel, dtype class, shape class -> fastest tiles (median ms)."]
  for (kernel, dtype, shape_class), (c, seconds) in sorted(best.items()):
    lines.append(
      f"    ('{kernel}', '{dtype}', '{shape_class}'): "
      f"TileConfig({c.block_m}, {c.block_n}, {c.block_k}, "
      f"num_warps={c.num_warps}, num_stages={c.num_stages}),"
      f"  # {seconds * 1e3:.3f} ms"
    )
  return "\n".join(lines) + "\n"


def write(config, workdir: str) -> None:
  """Tunes every kernel, dtype and shape class of `config`; writes the timings and the table to `workdir`."""
  check(config)
  device = jax.devices()[0]
  interpret = device.platform != "gpu"
  shapes = SMOKE_SHAPES if config.smoke else SHAPES
  warmup, iters = (1, 2) if config.smoke else (config.warmup, config.iters)
  best, records = tune(config.kernels, config.dtypes, shapes, candidates(config), warmup, iters, interpret)
  table = table_source(device.device_kind, best)
  print("\n" + table)
  os.makedirs(workdir, exist_ok=True)
  out_table, out_json = os.path.join(workdir, TABLE), os.path.join(workdir, RECORD)
  with open(out_table, "w") as f:
    f.write(table)
  with open(out_json, "w") as f:
    json.dump(
      dict(
        device_kind=device.device_kind,
        platform=device.platform,
        jax_version=jax.__version__,
        shapes=shapes,
        records=records,
        best={"/".join(k): dict(config=c.__dict__, median_s=s) for k, (c, s) in best.items()},
      ),
      f,
      indent=1,
    )
  print(f"wrote {out_json} and {out_table}")


def main(argv):
  del argv
  check(flags.FLAGS.config)
  workdir_guard.claim(flags.FLAGS.workdir, "experiments.tune_kernels", flags.FLAGS.config)  # before any timing
  write(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "tune_kernels.py"),
    "Tuning config file (configs/tune_kernels.py).",
  )
  cli.define_workdir("Directory of tune_kernels.json and tune_kernels_table.txt.")
  cli.run(main)
