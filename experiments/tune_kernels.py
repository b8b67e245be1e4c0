"""Re-tune the tile table of moejax.kernels.tuning on the GPU at hand.

For every (kernel, dtype, shape class) it times each candidate TileConfig on a representative
shape (balanced groups), keeps the fastest, prints a table, writes every timing as JSON and a
Python `TABLE` entry for kernels/tuning.py to paste:

  python -m experiments.tune_kernels --out_json tuned.json --out_table tuned_table.py
  python -m experiments.tune_kernels --smoke --out_json /tmp/t.json --out_table /tmp/t.py  # CPU

Candidates that fail to compile (e.g. too much shared memory) are recorded and skipped. The
default sweep (32 candidates x 4 kernels x 2 classes, bf16) takes roughly 10-20 minutes.
"""

import itertools
import json
import statistics

import jax
import jax.numpy as jnp
from absl import app, flags

from moejax.kernels import ffn, tuning
from moejax.kernels import gmm as gmm_lib

# shape class -> (M, G, d, f): many rows per group (Mixtral-like) or few (Qwen2-MoE-like).
SHAPES = {'many_rows': (8192, 8, 4096, 4096), 'few_rows': (8192, 64, 2048, 1408)}
SMOKE_SHAPES = {'many_rows': (64, 2, 32, 32), 'few_rows': (64, 4, 32, 32)}

FLAGS = flags.FLAGS
flags.DEFINE_string('out_json', None, 'Path of the JSON with every timing.', required=True)
flags.DEFINE_string('out_table', None, 'Path of the Python table to paste into tuning.py.',
                    required=True)
flags.DEFINE_bool('smoke', False, 'Tiny shapes, two candidates (runs on CPU, interpreted).')
flags.DEFINE_list('kernels', list(tuning.KERNELS), 'Kernels to tune.')
flags.DEFINE_list('dtypes', ['bfloat16'], 'Input dtypes to tune.')
flags.DEFINE_list('block_m', ['64', '128'], 'Candidate block_m.')
flags.DEFINE_list('block_n', ['64', '128'], 'Candidate block_n.')
flags.DEFINE_list('block_k', ['32', '64'], 'Candidate block_k.')
flags.DEFINE_list('num_warps', ['4', '8'], 'Candidate num_warps.')
flags.DEFINE_list('num_stages', ['3', '4'], 'Candidate num_stages.')
flags.DEFINE_integer('warmup', 3, 'Untimed runs after compilation.')
flags.DEFINE_integer('iters', 20, 'Timed runs; the median is kept.')


def candidates(smoke: bool) -> list[tuning.TileConfig]:
  if smoke:
    return [tuning.TileConfig(16, 16, 16, 4, 1), tuning.TileConfig(32, 32, 32, 4, 1)]
  axes = [[int(v) for v in getattr(FLAGS, name)]
          for name in ('block_m', 'block_n', 'block_k', 'num_warps', 'num_stages')]
  return [tuning.TileConfig(*values) for values in itertools.product(*axes)]


def kernel_call(kernel, shape, dtype, interpret):
  """fn(config) -> jitted call of `kernel` alone with those tiles, and its arguments."""
  m, g, d, f = shape
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (m, d), dtype)
  w_in = (d ** -0.5 * jax.random.normal(keys[1], (g, d, f))).astype(dtype)
  w_out = (f ** -0.5 * jax.random.normal(keys[2], (g, f, d))).astype(dtype)
  w_gate = (d ** -0.5 * jax.random.normal(keys[3], (g, d, f))).astype(dtype)
  dy = jax.random.normal(keys[4], (m, d), dtype)
  gs = jnp.full((g,), m // g, jnp.int32)

  def opts(config):
    return ffn.Options('silu', config, interpret)

  calls = {
      'gmm': (lambda c: lambda x, w, gs: gmm_lib.gmm(x, w, gs, tiling=c, interpret=interpret),
              (x, w_in, gs)),
      'ffn_in': (lambda c: lambda x, w, wg, gs: ffn.hidden(x, w, wg, gs, opts(c)),
                 (x, w_in, w_gate, gs)),
      'ffn_bwd': (lambda c: lambda dy, x, w, wo, wg, gs: ffn.hidden_backward(
          dy, x, w, wo, wg, gs, opts(c)), (dy, x, w_in, w_out, w_gate, gs)),
      'tgmm': (lambda c: lambda x, dy, gs: gmm_lib.tgmm(x, dy, gs, tiling=c, interpret=interpret),
               (x, dy, gs)),
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
      record = dict(kernel=kernel, dtype=str(dtype), shape_class=shape_class, shape=shape,
                    config=config.__dict__)
      try:
        times = tuning.time_call(make(config), args, warmup, iters)
        record.update(times_s=times, median_s=statistics.median(times))
      except Exception as e:  # pylint: disable=broad-except
        record['error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
      records.append(record)
      status = (f"{record['median_s'] * 1e3:9.3f} ms" if 'median_s' in record
                else record['error'][:70])
      print(f'{kernel:8s} {key[1]:5s} {shape_class:10s} {config}  {status}', flush=True)
      if 'median_s' in record and (key not in best or record['median_s'] < best[key][1]):
        best[key] = (config, record['median_s'])
  return best, records


def table_source(device: str, best) -> str:
  """`best` as Python lines for the device's table in kernels/tuning.py."""
  lines = [f'# Tuned on {device}: kernel, dtype class, shape class -> fastest tiles (median ms).']
  for (kernel, dtype, shape_class), (c, seconds) in sorted(best.items()):
    lines.append(f"    ('{kernel}', '{dtype}', '{shape_class}'): "
                 f'TileConfig({c.block_m}, {c.block_n}, {c.block_k}, '
                 f'num_warps={c.num_warps}, num_stages={c.num_stages}),'
                 f'  # {seconds * 1e3:.3f} ms')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  device = jax.devices()[0]
  interpret = device.platform != 'gpu'
  shapes = SMOKE_SHAPES if FLAGS.smoke else SHAPES
  warmup, iters = (1, 2) if FLAGS.smoke else (FLAGS.warmup, FLAGS.iters)
  best, records = tune(FLAGS.kernels, FLAGS.dtypes, shapes, candidates(FLAGS.smoke), warmup,
                       iters, interpret)
  table = table_source(device.device_kind, best)
  print('\n' + table)
  with open(FLAGS.out_table, 'w') as f:
    f.write(table)
  with open(FLAGS.out_json, 'w') as f:
    json.dump(dict(device_kind=device.device_kind, platform=device.platform,
                   jax_version=jax.__version__, shapes=shapes, records=records,
                   best={'/'.join(k): dict(config=c.__dict__, median_s=s)
                         for k, (c, s) in best.items()}), f, indent=1)
  print(f'wrote {FLAGS.out_json} and {FLAGS.out_table}')


if __name__ == '__main__':
  app.run(main)
