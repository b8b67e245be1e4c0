"""Timing the expert FFN's implementations (moejax.bench.kernel_impls, and torch's: moejax.bench.torch_ffn) on the
kernel benchmark's cases (moejax.bench.kernel_cases), forward and forward+backward, and the fused FFN's kernels one
by one (moejax.bench.kernel_parts): what experiments/bench_kernels.py and the GPU suite's kernels step record.

Each result is a dict: the case (model, its fields, rows, skew, group_sizes), op, passes, impl, useful_flops and
either times_s, median_s and tflops (with the error against ragged_dot for ERROR_CHECKED, against a per-group loop
for torch), or 'skipped' (a missing optional package or device) or 'error'.
"""

import statistics
import traceback

import jax
import jax.numpy as jnp

from kernels import tuning
from moejax.bench import kernel_parts, torch_ffn
from moejax.bench.kernel_cases import group_sizes, useful_flops
from moejax.bench.kernel_impls import make_fn, make_inputs, unavailable


def _rel_err(ours, ref) -> float:
  """Largest relative norm error over matching leaves (outputs and gradients)."""

  def norm(a):
    return float(jnp.linalg.norm(a.astype(jnp.float32)))

  errs = [norm(a - b) / norm(b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref))]
  return max(errs)


# Implementations whose outputs and gradients are compared with ragged_dot's on the same inputs.
ERROR_CHECKED = ("pallas", "pallas_saved", "tokamax", "fp8")


def bench_one(impl, op, bwd, model, rows, sizes, dtype, warmup, iters):
  """Timings of one implementation; for ERROR_CHECKED ones also their error against ragged_dot."""
  capacity = int(-(-sizes.max() // 128) * 128)
  params, dy = make_inputs(model, rows, dtype, op, impl)
  gs = jnp.asarray([rows] if impl == "dense_gemm" else sizes, jnp.int32)

  def compiled(fn):
    if not bwd:
      return jax.jit(fn)

    def fwd_bwd(params, gs):
      y, vjp = jax.vjp(lambda p: fn(p, gs), params)
      return y, vjp(dy.astype(y.dtype))

    return jax.jit(fwd_bwd)

  jitted = compiled(make_fn(impl, op, model, capacity))
  times = tuning.time_call(jitted, (params, gs), warmup, iters)
  median = statistics.median(times)
  entry = dict(times_s=times, median_s=median, tflops=useful_flops(model, rows, op, bwd) / median / 1e12)
  if impl == "dense_capacity":
    entry["capacity"] = capacity
  if impl in ERROR_CHECKED:
    ref = compiled(make_fn("ragged_dot", op, model, capacity))(params, gs)
    entry["rel_err_vs_ragged_dot"] = _rel_err(jitted(params, gs), ref)
  return entry


def run(models, rows_list, skews, ops, impls, dtype, warmup, iters) -> list[dict]:
  """Every result of `impls` (each forward, then forward+backward) for each of `ops` ('gmm', 'ffn', or 'parts': the
  fused FFN's kernels) at each case, row count and skew; each printed as it is measured."""
  results = []
  for name, model in models.items():
    for rows in rows_list:
      for skew in skews:
        sizes = group_sizes(rows, model["experts"], skew)
        for op in ops:
          if op == "parts":  # each kernel of the fused FFN alone (implementation 'pallas' only)
            results.extend(kernel_parts.run(name, model, rows, skew, dtype, warmup, iters))
            continue
          for bwd in (False, True):
            for impl in impls:
              entry = dict(
                model=name,
                **model,
                rows=rows,
                skew=skew,
                group_sizes=sizes.tolist(),
                op=op,
                passes="fwd_bwd" if bwd else "fwd",
                impl=impl,
                useful_flops=useful_flops(model, rows, op, bwd),
              )
              skipped = unavailable(impl, dtype)
              try:
                if skipped:
                  entry["skipped"] = skipped
                elif impl == "torch_grouped_mm":
                  entry.update(torch_ffn.bench_one(op, bwd, model, rows, sizes, warmup, iters))
                else:
                  entry.update(bench_one(impl, op, bwd, model, rows, sizes, dtype, warmup, iters))
              except Exception as e:  # pylint: disable=broad-except
                entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if impl != "tokamax":
                  traceback.print_exc()
              results.append(entry)
              print(_row(entry), flush=True)
  return results


def _row(e):
  err = next((f"  rel err {e[k]:.1e}" for k in ("rel_err_vs_ragged_dot", "rel_err_vs_loop") if k in e), "")
  timing = (
    f"{e['median_s'] * 1e3:10.3f} ms {e['tflops']:8.3g} TFLOP/s{err}"
    if "median_s" in e
    else f"  skipped: {e['skipped'][:60]}"
    if "skipped" in e
    else f"  {e['error'][:60]}"
  )
  return f"{e['model']:14s} R={e['rows']:6d} {e['skew']:8s} {e['op']:4s} {e['passes']:7s} {e['impl']:15s}{timing}"


def summary(results, impls) -> str:
  """One line per case: median ms (TFLOP/s) of every implementation side by side."""
  cases = {}
  for e in results:
    if e["op"] == "parts":
      continue
    key = (e["model"], e["rows"], e["skew"], e["op"], e["passes"])
    cases.setdefault(key, {})[e["impl"]] = (
      f"{e['median_s'] * 1e3:9.3f} ({e['tflops']:6.3g})" if "median_s" in e else f"{'-':>18s}"
    )
  lines = [f"{'case':44s}" + "".join(f"{impl:>19s}" for impl in impls)]
  for (model, rows, skew, op, passes), by_impl in cases.items():
    lines.append(
      f"{model:14s} {rows:6d} {skew:8s} {op:4s} {passes:7s}"
      + "".join(f" {by_impl.get(impl, '-'):>18s}" for impl in impls)
    )
  return "\n".join(lines)
