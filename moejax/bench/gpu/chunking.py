"""The chunking step: Comet's costs of decomposing the expert GEMMs (row chunks of the first, column blocks of d of
the second, against one call), and the layer's forward+backward under each schedule on a 1x1 mesh."""

import os

import jax
import jax.numpy as jnp

from kernels.tuning import time_call
from moejax.bench.gpu.layer import compute_dtype, layer_case, read_ceiling
from moejax.bench.gpu.record import Record, say, timing
from moejax.bench.gpu.shapes import CHUNKS, LAYER_MODELS, SMOKE_LAYER_MODELS
from moejax.cost import model as cost_model
from moejax.moe import experts as experts_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib


def _pieces_program(pieces: int, by: str, backend: str):
  """One grouped matmul x [R, K] @ w [G, K, N] as `pieces` calls: contiguous row chunks (each with
  its own balanced groups) or column blocks of N; jitted."""

  def run(x, w):
    groups, rows = w.shape[0], x.shape[0]
    if by == "rows":
      chunk = rows // pieces
      sizes = jnp.full((groups,), chunk // groups, jnp.int32)
      return jnp.concatenate(
        [experts_lib.grouped_matmul(x[i * chunk : (i + 1) * chunk], w, sizes, backend) for i in range(pieces)]
      )
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    width = w.shape[2] // pieces
    return jnp.concatenate(
      [experts_lib.grouped_matmul(x, w[:, :, i * width : (i + 1) * width], sizes, backend) for i in range(pieces)],
      axis=1,
    )

  return jax.jit(run)


def step_chunking(config, rec: Record):
  shape = SMOKE_LAYER_MODELS["smoke_gated_e8"] if config.smoke else LAYER_MODELS["mixtral_8x7b"]
  shape = dict(shape)
  tokens = shape.pop("tokens")
  rows, d, f, groups = tokens * shape["top_k"], shape["d_model"], shape["d_ff"], shape["num_experts"]
  dtype = compute_dtype(config)
  ceiling, source = read_ceiling(rec.workdir)
  chunks, backends = ((1, 2), ["ragged_dot"]) if config.smoke else (CHUNKS, config.layer_backends)
  rec.data.update(
    shape=shape,
    rows=rows,
    dtype=dtype,
    chunks=chunks,
    gemm_tflops=ceiling,
    mfu_reference=source,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
  )
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (rows, d), dtype)
  h = jax.random.normal(keys[1], (rows, f), dtype)
  w_in = jax.random.normal(keys[2], (groups, d, f), dtype) / d**0.5
  w_out = jax.random.normal(keys[3], (groups, f, d), dtype) / f**0.5
  gemms = []
  rec["gemms"] = gemms
  for backend in backends:
    for gemm, by, operands in (("first_gemm", "rows", (x, w_in)), ("second_gemm", "columns", (h, w_out))):
      single = None
      for pieces in chunks:
        case = {
          "gemm": gemm,
          "split": by,
          "pieces": pieces,
          "expert_backend": backend,
          **timing(time_call(_pieces_program(pieces, by, backend), operands, config.warmup, config.iters)),
        }
        single = single or case["median_s"]
        case["tflops"] = float(cost_model.matmul_flops(rows, d, f)) / case["median_s"] / 1e12
        case["time_vs_one_call"] = case["median_s"] / single
        gemms.append(case)
        say(
          f"{gemm} {backend} {pieces} {by} pieces: {case['median_s'] * 1e3:.3f} ms "
          f"({case['time_vs_one_call']:.3f}x one call, {case['tflops']:.1f} TFLOP/s)"
        )
        rec.save()
  mesh = mesh_lib.make_mesh(1, 1)
  schedules = []
  rec["schedules"] = schedules
  for backend in backends:
    for schedule, pieces in (("sequential", 1), *(("chunked", c) for c in chunks[1:]), *(("comet", c) for c in chunks)):
      cfg = MoEConfig(
        **shape, collective="padded", expert_backend=backend, dtype=dtype, schedule=schedule, num_chunks=pieces
      )
      case = {"schedule": schedule, "num_chunks": pieces, "expert_backend": backend}
      case.update(layer_case(cfg, tokens, mesh, config, ceiling, phases=False)[0])
      schedules.append(case)
      say(
        f"layer {backend} {schedule} C={pieces}: fwd {case['fwd']['median_s'] * 1e3:.3f} ms, "
        f"fwd+bwd {case['fwd_bwd']['median_s'] * 1e3:.3f} ms"
      )
      rec.save()
