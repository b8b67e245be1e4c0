"""Benchmark the Pallas expert kernels against other ways to compute the same expert FFN.

Implementations, each timed forward and forward+backward:
  pallas          kernels (gmm, or the fused expert_ffn)
  pallas_saved    the fused expert_ffn keeping its pre-activations for the backward (no recompute;
                  for 'gmm' the same as pallas)
  pallas_unfused  the FFN as separate kernels gmm calls with the activation between them
                  (what the fused expert_ffn must beat; for 'gmm' the same as pallas)
  ragged_dot      jax.lax.ragged_dot
  tokamax         expert_backend='tokamax' through moejax.moe.experts (tokamax.ragged_dot, fp32
                  out, rows past the groups masked), when tokamax is importable
  fp8             expert_backend='fp8' through moejax.moe.experts (every matmul in float8_e4m3fn by
                  qwix.ragged_dot, kernels.fp8), when qwix is importable
  torch_grouped_mm  the same FFN in PyTorch with torch._grouped_mm (torchtitan's MoE path), on CUDA,
                  timed with CUDA events; weights laid out as torchtitan's ([G, out, in], used
                  transposed); its error against a per-group torch matmul loop
  dense_capacity  rows scattered into [G, capacity, d] (capacity = largest group rounded up to
                  128, so nothing is dropped), per-expert einsum, gathered back
  dense_gemm      one dense GEMM chain with the same useful FLOPs (the device's practical peak)
Ops: 'gmm' (x [R, d] @ w_in [G, d, f]), 'ffn' (the whole expert FFN) and 'parts' (each kernel of the fused
FFN alone, forward and backward: moejax/bench/kernel_parts.py). TFLOP/s count useful
FLOPs only (2 * R * d * f per matmul, x3 for forward+backward): recomputation in our backward
and capacity padding show up as lower TFLOP/s. Each pallas, pallas_saved, tokamax and fp8 result also
records its relative error (outputs and gradients) against ragged_dot on the same inputs. An implementation
whose package or device is missing (tokamax; qwix for fp8; torch or CUDA for torch_grouped_mm) is recorded with
'skipped': the reason, and no timings.

  python -m experiments.bench_kernels --workdir=results/kernels_h100
  python -m experiments.bench_kernels --workdir=/tmp/smoke --config.smoke=True   # CPU, tiny, interpreted
  python -m experiments.bench_kernels --workdir=/tmp/k --config.shape=16,32,2,1,silu --config.rows=256 \\
      --config.ops=ffn --config.backend_table=True   # one layer's per-device shape, for expert_backend='auto'

Every option is a field of configs/bench_kernels.py. Writes <workdir>/kernels.json and, with backend_table,
<workdir>/backend_table.json (what expert_backend='auto' reads: expert_table='<workdir>/backend_table.json').
A full run (5 models x 3 row counts x 2 skews x 2 ops x 2 passes x 9 implementations) takes
tens of minutes on an H100; config.models/rows/ops narrow it. The shapes and FLOP counts are in
moejax/bench/kernel_cases.py, the JAX implementations in moejax/bench/kernel_impls.py, torch's in
moejax/bench/torch_ffn.py, their timing in moejax/bench/kernels.py; this program writes the record.
"""

import json
import os

import jax
import jax.numpy as jnp
import jaxlib
from absl import flags

from moejax import cli
from moejax.bench import kernels
from moejax.bench.kernel_cases import MODELS, SMOKE_MODELS, custom_model
from moejax.bench.kernel_impls import IMPLS
from moejax.cost import expert_backend
from moejax.validation import require

RECORD, BACKEND_TABLE = "kernels.json", "backend_table.json"
CHOICES = {"models": MODELS, "skews": ("balanced", "skewed"), "ops": ("gmm", "ffn", "parts"), "impls": IMPLS}


def cases(config) -> tuple[dict, list[int], int, int]:
  """(the cases by name, row counts, warm-up and timed runs) of a checked config; a ConfigError names a bad
  field."""
  for field, allowed in CHOICES.items():
    bad = [v for v in config[field] if v not in allowed]
    require(not bad, field, ",".join(config[field]), f"a subset of {list(allowed)} ({bad} are not)")
  require(config.dtype in ("bfloat16", "float32"), "dtype", config.dtype, "bfloat16 or float32")
  if config.smoke:
    return SMOKE_MODELS, [64], 1, 3
  models = {"custom": custom_model(config.shape)} if config.shape else {m: MODELS[m] for m in config.models}
  return models, list(config.rows), config.warmup, config.iters


def write(config, workdir: str) -> None:
  """Times every case of `config`, prints the summary and writes the record (and the backend table) to
  `workdir`."""
  models, rows, warmup, iters = cases(config)
  dtype = jnp.dtype(config.dtype)
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
  results = kernels.run(models, rows, config.skews, config.ops, config.impls, dtype, warmup, iters)
  print("\nmedian ms (useful TFLOP/s)")
  print(kernels.summary(results, config.impls))
  record = dict(
    device_kind=device.device_kind,
    platform=device.platform,
    jax_version=jax.__version__,
    jaxlib_version=jaxlib.__version__,
    dtype=str(dtype),
    warmup=warmup,
    iters=iters,
    smoke=config.smoke,
    results=results,
  )
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, RECORD)
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {len(results)} results to {path}")
  if config.backend_table:
    meta = dict(
      device=device.device_kind,
      platform=device.platform,
      dtype=str(dtype),
      smoke=config.smoke,
      versions=dict(jax=jax.__version__, jaxlib=jaxlib.__version__),
      source=RECORD,
    )
    table = os.path.join(workdir, BACKEND_TABLE)
    with open(table, "w") as f:
      json.dump(expert_backend.table_from_results(results, meta), f, indent=1)
    print(f"wrote the expert-backend table to {table}")


def main(argv):
  del argv
  write(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":  # the flags are the program's: the GPU suite and tests import this module
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bench_kernels.py"),
    "Benchmark config file (configs/bench_kernels.py).",
  )
  cli.define_workdir("Directory of kernels.json (and backend_table.json).")
  cli.run(main)
