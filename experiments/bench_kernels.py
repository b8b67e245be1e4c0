"""Benchmark the Pallas expert kernels against other ways to compute the same expert FFN.

Implementations, each timed forward and forward+backward:
  pallas          moejax.kernels (gmm, or the fused expert_ffn)
  pallas_unfused  the FFN as separate moejax.kernels gmm calls with the activation between them
                  (what the fused expert_ffn must beat; for 'gmm' the same as pallas)
  ragged_dot      jax.lax.ragged_dot
  tokamax         expert_backend='tokamax' through moejax.moe.experts (tokamax.ragged_dot, fp32
                  out, rows past the groups masked), when tokamax is importable
  torch_grouped_mm  the same FFN in PyTorch with torch._grouped_mm (torchtitan's MoE path), on CUDA,
                  timed with CUDA events; weights laid out as torchtitan's ([G, out, in], used
                  transposed); its error against a per-group torch matmul loop
  dense_capacity  rows scattered into [G, capacity, d] (capacity = largest group rounded up to
                  128, so nothing is dropped), per-expert einsum, gathered back
  dense_gemm      one dense GEMM chain with the same useful FLOPs (the device's practical peak)
Ops: 'gmm' (x [R, d] @ w_in [G, d, f]), 'ffn' (the whole expert FFN) and 'parts' (each kernel of the fused
FFN alone, forward and backward: experiments/kernel_parts.py). TFLOP/s count useful
FLOPs only (2 * R * d * f per matmul, x3 for forward+backward): recomputation in our backward
and capacity padding show up as lower TFLOP/s. Each pallas result also records its relative
error (outputs and gradients) against ragged_dot on the same inputs. An implementation whose
package or device is missing (tokamax; torch or CUDA for torch_grouped_mm) is recorded with
'skipped': the reason, and no timings.

  python -m experiments.bench_kernels --out results/kernels_h100.json
  python -m experiments.bench_kernels --smoke --out /tmp/smoke.json   # CPU, tiny, interpreted
  python -m experiments.bench_kernels --shape=4096,14336,1,1,silu --rows=16384 --ops=ffn --out=k.json \
      --backend_table=table.json   # one layer's per-device shape, for expert_backend='auto' (expert_table=...)
A full run (4 models x 3 row counts x 2 skews x 2 ops x 2 passes x 5 implementations) takes
tens of minutes on an H100; --models/--rows/--ops narrow it. The shapes and FLOP counts are in
experiments/kernel_cases.py, the JAX implementations in experiments/kernel_impls.py, torch's in
experiments/torch_ffn_bench.py; this module times them and writes the record.
"""

import json
import os
import statistics
import traceback

import jax
import jax.numpy as jnp
import jaxlib
from absl import app, flags

from experiments import kernel_parts, torch_ffn_bench
from experiments.kernel_cases import MODELS, SMOKE_MODELS, group_sizes, useful_flops
from experiments.kernel_impls import IMPLS, make_fn, make_inputs, unavailable
from moejax.cost import expert_backend
from moejax.kernels import tuning
from moejax.kernels.activations import ACTIVATIONS

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags, defined when run as a program (the GPU suite and tests import this module
  beside experiments that define flags of the same names)."""
  flags.DEFINE_string('out', None, 'Path of the JSON results file.', required=True)
  flags.DEFINE_bool('smoke', False, 'Tiny shapes and few runs (runs on CPU, interpreted).')
  flags.DEFINE_list('models', list(MODELS), f'Subset of {list(MODELS)}.')
  flags.DEFINE_list('shape', None, 'D,F,EXPERTS,GATED,ACTIVATION: time this FFN shape (model "custom") instead of '
                    '--models, e.g. a layer\'s per-device shape that expert_backend=\'auto\' asked for.')
  flags.DEFINE_string('backend_table', None, "Also write the expert-backend table (what expert_backend='auto' "
                      'reads, `moejax.cost.expert_backend`) of the ffn results here.')
  flags.DEFINE_list('rows', ['4096', '16384', '65536'], 'Routed rows R on the GPU.')
  flags.DEFINE_list('skews', ['balanced', 'skewed'], 'Group-size distributions.')
  flags.DEFINE_list('ops', ['gmm', 'ffn'], "Operations: 'gmm', 'ffn', 'parts'.")
  flags.DEFINE_list('impls', list(IMPLS), 'Implementations.')
  flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'Compute dtype.')
  flags.DEFINE_integer('warmup', 5, 'Untimed runs after compilation.')
  flags.DEFINE_integer('iters', 50, 'Timed runs; the median is reported.')


def _rel_err(ours, ref) -> float:
  """Largest relative norm error over matching leaves (outputs and gradients)."""
  def norm(a):
    return float(jnp.linalg.norm(a.astype(jnp.float32)))
  errs = [norm(a - b) / norm(b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref))]
  return max(errs)


def bench_one(impl, op, bwd, model, rows, sizes, dtype, warmup, iters):
  """Timings of one implementation; for 'pallas' also its error against ragged_dot."""
  capacity = int(-(-sizes.max() // 128) * 128)
  params, dy = make_inputs(model, rows, dtype, op, impl)
  gs = jnp.asarray([rows] if impl == 'dense_gemm' else sizes, jnp.int32)

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
  entry = dict(times_s=times, median_s=median,
               tflops=useful_flops(model, rows, op, bwd) / median / 1e12)
  if impl == 'dense_capacity':
    entry['capacity'] = capacity
  if impl == 'tokamax':
    entry['rel_err_vs_ragged_dot'] = _rel_err(jitted(params, gs), compiled(make_fn('ragged_dot', op, model,
                                                                                     capacity))(params, gs))
  if impl == 'pallas':
    ref = compiled(make_fn('ragged_dot', op, model, capacity))(params, gs)
    entry['rel_err_vs_ragged_dot'] = _rel_err(jitted(params, gs), ref)
  return entry


def run(models, rows_list, skews, ops, impls, dtype, warmup, iters):
  results = []
  for name, model in models.items():
    for rows in rows_list:
      for skew in skews:
        sizes = group_sizes(rows, model['experts'], skew)
        for op in ops:
          if op == 'parts':  # each kernel of the fused FFN alone (implementation 'pallas' only)
            results.extend(kernel_parts.run(name, model, rows, skew, dtype, warmup, iters))
            continue
          for bwd in (False, True):
            for impl in impls:
              entry = dict(model=name, **model, rows=rows, skew=skew, group_sizes=sizes.tolist(),
                           op=op, passes='fwd_bwd' if bwd else 'fwd', impl=impl,
                           useful_flops=useful_flops(model, rows, op, bwd))
              skipped = unavailable(impl, dtype)
              try:
                if skipped:
                  entry['skipped'] = skipped
                elif impl == 'torch_grouped_mm':
                  entry.update(torch_ffn_bench.bench_one(op, bwd, model, rows, sizes, warmup, iters))
                else:
                  entry.update(bench_one(impl, op, bwd, model, rows, sizes, dtype, warmup, iters))
              except Exception as e:  # pylint: disable=broad-except
                entry['error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
                if impl != 'tokamax':
                  traceback.print_exc()
              results.append(entry)
              print(_row(entry), flush=True)
  return results


def _row(e):
  err = next((f'  rel err {e[k]:.1e}' for k in ('rel_err_vs_ragged_dot', 'rel_err_vs_loop') if k in e), '')
  timing = (f"{e['median_s'] * 1e3:10.3f} ms {e['tflops']:8.3g} TFLOP/s{err}" if 'median_s' in e
            else f"  skipped: {e['skipped'][:60]}" if 'skipped' in e
            else f"  {e['error'][:60]}")
  return (f"{e['model']:14s} R={e['rows']:6d} {e['skew']:8s} {e['op']:4s} {e['passes']:7s} "
          f"{e['impl']:15s}{timing}")


def custom_model(shape: list[str]) -> dict:
  """--shape's D,F,EXPERTS,GATED,ACTIVATION as a kernel_cases model; a clear error on anything else."""
  try:
    d, f, experts, gated, activation = shape
    model = dict(d=int(d), f=int(f), experts=int(experts), top_k=1, gated=bool(int(gated)), activation=activation)
  except ValueError as e:
    raise app.UsageError(f'--shape={",".join(shape)}: expected D,F,EXPERTS,GATED,ACTIVATION, e.g. '
                         f'4096,14336,1,1,silu ({e})') from e
  if min(model['d'], model['f'], model['experts']) < 1 or activation not in ACTIVATIONS:
    raise app.UsageError(f'--shape={",".join(shape)}: D, F, EXPERTS positive, ACTIVATION one of {list(ACTIVATIONS)}')
  return model


def summary(results, impls) -> str:
  """One line per case: median ms (TFLOP/s) of every implementation side by side."""
  cases = {}
  for e in results:
    if e['op'] == 'parts':
      continue
    key = (e['model'], e['rows'], e['skew'], e['op'], e['passes'])
    cases.setdefault(key, {})[e['impl']] = (
        f"{e['median_s'] * 1e3:9.3f} ({e['tflops']:6.3g})" if 'median_s' in e else f"{'-':>18s}")
  lines = [f"{'case':44s}" + ''.join(f'{impl:>19s}' for impl in impls)]
  for (model, rows, skew, op, passes), by_impl in cases.items():
    lines.append(f'{model:14s} {rows:6d} {skew:8s} {op:4s} {passes:7s}' +
                 ''.join(f' {by_impl.get(impl, "-"):>18s}' for impl in impls))
  return '\n'.join(lines)


def main(argv):
  del argv
  models = (SMOKE_MODELS if FLAGS.smoke else {'custom': custom_model(FLAGS.shape)} if FLAGS.shape else
            {m: MODELS[m] for m in FLAGS.models})
  rows_list = [64] if FLAGS.smoke else [int(r) for r in FLAGS.rows]
  warmup, iters = (1, 3) if FLAGS.smoke else (FLAGS.warmup, FLAGS.iters)
  dtype = jnp.dtype(FLAGS.dtype)
  device = jax.devices()[0]
  print(f'device: {device.device_kind} ({device.platform}), jax {jax.__version__}')
  results = run(models, rows_list, FLAGS.skews, FLAGS.ops, FLAGS.impls, dtype, warmup, iters)
  print('\nmedian ms (useful TFLOP/s)')
  print(summary(results, FLAGS.impls))
  record = dict(device_kind=device.device_kind, platform=device.platform,
                jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
                dtype=str(dtype), warmup=warmup, iters=iters, smoke=FLAGS.smoke, results=results)
  with open(FLAGS.out, 'w') as f:
    json.dump(record, f, indent=1)
  print(f'wrote {len(results)} results to {FLAGS.out}')
  if FLAGS.backend_table:
    meta = dict(device=device.device_kind, platform=device.platform, dtype=str(dtype), smoke=FLAGS.smoke,
                versions=dict(jax=jax.__version__, jaxlib=jaxlib.__version__), source=os.path.basename(FLAGS.out))
    with open(FLAGS.backend_table, 'w') as f:
      json.dump(expert_backend.table_from_results(results, meta), f, indent=1)
    print(f'wrote the expert-backend table to {FLAGS.backend_table}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
