"""The layer step: the MoE layer (`moejax.moe.layer.moe_apply`) on a 1x1 mesh, forward and forward+backward, its
phases and MFU against this run's ceilings; the 'ragged' and 'padded' collectives compared (also under overflow);
one row per choice against dedup and an FP8 / BF16 wire."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels.tuning import time_call
from moejax.bench.gpu.record import Record, say, timing
from moejax.bench.gpu.shapes import LAYER_MODELS, SMOKE_LAYER_MODELS
from moejax.cost import model as cost_model
from moejax.moe import collective as collective_lib
from moejax.moe import layer as layer_lib
from moejax.moe import params as params_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.study import phase_timing


def read_ceiling(out_dir: str) -> tuple[float | None, str]:
  """(GEMM TFLOP/s, where from) of this run's ceilings step, or (None, why not)."""
  path = os.path.join(out_dir, "ceilings.json")
  try:
    with open(path) as f:
      ceilings = json.load(f)
  except (OSError, ValueError) as e:
    return None, f"no ceilings from this run ({type(e).__name__}: {path})"
  if ceilings.get("status") != "ok" or not ceilings.get("gemm_tflops"):
    return None, f"ceilings step status {ceilings.get('status')!r}"
  if ceilings.get("device") != jax.devices()[0].device_kind:
    return None, f"ceilings measured on {ceilings.get('device')!r}"
  return ceilings["gemm_tflops"], f"{path}: best bf16 GEMM (n={ceilings.get('gemm_tflops_size')})"


def expert_flops(cfg: MoEConfig, tokens: int) -> int:
  """Forward FLOPs of the expert matmuls on tokens x K rows (`moejax.cost.model.expert_flops`)."""
  return int(cost_model.expert_flops(tokens * cfg.choices_per_token, cfg.d_model, cfg.d_ff, cfg.gated))


def compute_dtype(config) -> str:
  return config.dtype or ("bfloat16" if jax.devices()[0].platform == "gpu" else "float32")


def layer_case(
  cfg: MoEConfig, tokens: int, mesh, config, ceiling: float | None, phases: bool = True
) -> tuple[dict, np.ndarray]:
  """Timings, counts, FLOPs and MFU of the layer `cfg` on `tokens` random tokens, and its output y [tokens, d]
  (float32); `phases`: also the forward's phases (`phase_timing.measure_phases`)."""
  dtype = jnp.dtype(cfg.dtype)
  k_params, k_x, k_dy = jax.random.split(jax.random.key(0), 3)
  specs = params_lib.param_specs(cfg)
  params = jax.tree.map(
    lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)),
    params_lib.init_params(k_params, cfg, dtype),
    specs,
  )
  tokens_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh_lib.AXES))
  x = jax.device_put(jax.random.normal(k_x, (tokens, cfg.d_model), dtype), tokens_sharding)
  dy = jax.device_put(jax.random.normal(k_dy, (tokens, cfg.d_model), jnp.float32), tokens_sharding)

  forward = jax.jit(lambda p, v: layer_lib.moe_apply(p, v, cfg, mesh))

  def loss(p, v):
    y, aux = layer_lib.moe_apply(p, v, cfg, mesh)
    return jnp.sum(y.astype(jnp.float32) * dy) + aux["aux_loss"]

  forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  case = {
    "fwd": timing(time_call(forward, (params, x), config.warmup, config.iters)),
    "fwd_bwd": timing(time_call(forward_backward, (params, x), config.warmup, config.iters)),
  }
  y, aux = forward(params, x)
  case.update(
    tokens_dropped=int(aux["tokens_dropped"]),
    tokens_overflowed=int(aux["tokens_overflowed"]),
    expert_counts=np.asarray(aux["expert_counts"]).tolist(),
  )
  flops = expert_flops(cfg, tokens)
  case.update(expert_flops_fwd=flops, expert_flops_fwd_bwd=3 * flops)
  rates = [("fwd", flops, case["fwd"]["median_s"]), ("fwd_bwd", 3 * flops, case["fwd_bwd"]["median_s"])]
  if phases:
    case["phases_ms"] = phase_timing.measure_phases(params, x, cfg, mesh, config.warmup, config.iters)
    rates.append(("expert_phase", flops, case["phases_ms"]["layer_expert_ms"] / 1e3))
  for name, useful, seconds in rates:
    case[f"tflops_{name}"] = useful / seconds / 1e12
    case[f"mfu_{name}"] = None if ceiling is None else case[f"tflops_{name}"] / ceiling
  return case, np.asarray(y, np.float32)


def _collective_cases(name: str, shape: dict, tokens: int, backend: str, mesh, config, ceiling, rec: Record):
  """One model and expert backend under each collective of RAGGED_AND_ORACLE (one the platform lacks recorded as
  skipped): the cases appended to rec['cases'] as they are timed; returns each run collective's outputs."""
  platform = jax.devices()[0].platform
  dtype = rec["dtype"]
  outputs = {}
  for collective in collective_lib.RAGGED_AND_ORACLE:
    cfg = MoEConfig(**shape, collective=collective, expert_backend=backend, dtype=dtype)
    case = {
      "model": name,
      "tokens": tokens,
      "rows": tokens * cfg.choices_per_token,
      **shape,
      "collective": collective,
      "expert_backend": backend,
      "dtype": dtype,
    }
    if not collective_lib.runs_on(collective, platform):
      case["skipped"] = f"XLA:{platform.upper()} has no ragged all-to-all (moejax.runtime.platform)"
    else:
      measured, outputs[collective] = layer_case(cfg, tokens, mesh, config, ceiling)
      case.update(measured)
      say(
        f"{name} {backend} {collective}: fwd {case['fwd']['median_s'] * 1e3:.3f} ms, fwd+bwd "
        f"{case['fwd_bwd']['median_s'] * 1e3:.3f} ms, expert phase {case['phases_ms']['layer_expert_ms']:.3f} "
        f"ms, MFU fwd {case['mfu_fwd']}, fwd+bwd {case['mfu_fwd_bwd']}"
      )
    rec["cases"].append(case)
    rec.save()
  return outputs


def _collective_comparison(name: str, backend: str, outputs: dict, platform: str) -> dict:
  """The 'ragged' collective's outputs against 'padded''s (max abs diff, relative error, bitwise equal), or why
  they were not compared."""
  comparison = {"model": name, "expert_backend": backend}
  if len(outputs) == 2:
    a, b = outputs["ragged"], outputs["padded"]
    comparison.update(
      max_abs_diff=float(np.max(np.abs(a - b))),
      rel_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
      bitwise_equal=bool(np.array_equal(a, b)),
    )
  else:
    comparison["skipped"] = "ragged collective not run on " + platform
  return comparison


def step_layer(config, rec: Record):
  platform = jax.devices()[0].platform
  models = SMOKE_LAYER_MODELS if config.smoke else {m: LAYER_MODELS[m] for m in config.layer_models}
  ceiling, source = read_ceiling(rec.workdir)
  dtype = compute_dtype(config)
  rec.data.update(
    mesh="1x1",
    dtype=dtype,
    warmup=config.warmup,
    iters=config.iters,
    gemm_tflops=ceiling,
    mfu_reference=source,
    models=models,
  )
  say(f"MFU reference: {ceiling} TFLOP/s ({source})")
  mesh = mesh_lib.make_mesh(1, 1)
  rec["cases"], rec["collective_comparison"] = [], []
  for name, shape in models.items():
    shape = dict(shape)
    tokens = shape.pop("tokens")
    for backend in config.layer_backends:
      outputs = _collective_cases(name, shape, tokens, backend, mesh, config, ceiling, rec)
      comparison = _collective_comparison(name, backend, outputs, platform)
      rec["collective_comparison"].append(comparison)
      say(f"ragged vs padded {name} {backend}: {comparison}")
      rec.save()
    rec.setdefault("wire_comparison", []).extend(
      _wire_comparison(name, shape, tokens, dtype, mesh, platform, config, ceiling)
    )
    rec.save()
    overflow = _overflow_comparison(shape, tokens, dtype, mesh, platform)
    overflow["model"] = name
    rec.setdefault("overflow_comparison", []).append(overflow)
    say(f"ragged vs padded under buffer overflow {name}: {overflow}")
    rec.save()


# What deduplicating and quantising the rows cost on one device, where nothing crosses a link: one row per choice,
# one per token (dedup: the experts expand each row to its choices and sum them back), and FP8 out / BF16 back.
WIRE_VARIANTS = {
  "per_choice": dict(dedup=False),
  "dedup": dict(dedup=True),
  "dedup_fp8_bf16": dict(dedup=True, dispatch_dtype="float8_e4m3fn", combine_dtype="bfloat16"),
}


def _wire_comparison(
  name: str, shape: dict, tokens: int, dtype: str, mesh, platform: str, config, ceiling: float | None
) -> list[dict]:
  """Forward and forward+backward times of the layer per `WIRE_VARIANTS` (the first expert backend, the platform's
  one-hop collective), and each output's error against the per-choice one."""
  backend, collective = config.layer_backends[0], collective_lib.resolve("auto", platform)
  cases, baseline = [], None
  for variant, fields in WIRE_VARIANTS.items():
    cfg = MoEConfig(**shape, collective=collective, expert_backend=backend, dtype=dtype, **fields)
    measured, y = layer_case(cfg, tokens, mesh, config, ceiling, phases=False)
    baseline = y if baseline is None else baseline
    case = {
      "model": name,
      "variant": variant,
      "collective": collective,
      "expert_backend": backend,
      **fields,
      **measured,
      "rel_err_vs_per_choice": float(np.linalg.norm(y - baseline) / max(np.linalg.norm(baseline), 1e-30)),
    }
    say(
      f"{name} {variant}: fwd {case['fwd']['median_s'] * 1e3:.3f} ms, fwd+bwd {case['fwd_bwd']['median_s'] * 1e3:.3f}"
      f" ms, rel err vs per-choice {case['rel_err_vs_per_choice']:.2e}"
    )
    cases.append(case)
  return cases


OVERFLOW_BUFFER_FACTOR = 0.5  # on one device every row stays local: half of them overflow


def _overflow_comparison(shape: dict, tokens: int, dtype: str, mesh, platform: str) -> dict:
  """Forward outputs and overflow counts of 'ragged' and 'padded' with receive buffers too small."""
  out = {"buffer_factor": OVERFLOW_BUFFER_FACTOR, "expert_backend": "ragged_dot"}
  if not collective_lib.runs_on("ragged", platform):
    out["skipped"] = "ragged collective not run on " + platform
    return out
  k_params, k_x = jax.random.split(jax.random.key(0))
  results = {}
  for collective in collective_lib.RAGGED_AND_ORACLE:
    cfg = MoEConfig(
      **shape, collective=collective, expert_backend="ragged_dot", dtype=dtype, buffer_factor=OVERFLOW_BUFFER_FACTOR
    )
    params = params_lib.init_params(k_params, cfg, jnp.dtype(dtype))
    x = jax.random.normal(k_x, (tokens, cfg.d_model), jnp.dtype(dtype))
    y, aux = jax.jit(lambda p, v, cfg=cfg: layer_lib.moe_apply(p, v, cfg, mesh))(params, x)
    results[collective] = np.asarray(y, np.float32)
    out[f"tokens_overflowed_{collective}"] = int(aux["tokens_overflowed"])
    out[f"zero_rows_{collective}"] = int(np.sum(np.all(results[collective] == 0, axis=1)))
  a, b = results["ragged"], results["padded"]
  out.update(
    max_abs_diff=float(np.max(np.abs(a - b))),
    bitwise_equal=bool(np.array_equal(a, b)),
    rel_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
  )
  return out
