"""One step of the GPU benchmark suite: measures, and writes every timing to OUT/<step>.json.

Steps (each meant to run as a process of its own; benchmarks/gpu_suite.sh runs them in order):
  env         device, driver (nvidia-smi), jax/jaxlib/flax versions, platform, optional packages.
  ceilings    bf16 dense GEMM TFLOP/s (square, several sizes) and on-device copy GB/s: the rates
              the other steps are judged against.
  kernels     experiments/bench_kernels.py (`run`) at Mixtral 8x7B, Qwen2-MoE and SMILE 3.7B (E 8)
              expert shapes, 16k routed rows, balanced and skewed groups, gmm and the whole expert
              FFN, forward and forward+backward, every implementation bench_kernels knows (tokamax and
              torch._grouped_mm recorded as skipped, with the reason, where their package or CUDA is
              missing); and OUT/backend_table.json: per FFN shape and pass, the fastest moejax backend.
  layer       the MoE layer (`moejax.moe.layer.moe_apply`) on a 1x1 mesh: forward and
              forward+backward, the forward's phases (`moejax.study.phase_timing.measure_phases`),
              MFU of the expert FLOPs against this run's ceilings GEMM rate, and the outputs of the
              'ragged' and 'padded' transports compared ('ragged' is skipped where XLA has no ragged
              all-to-all, e.g. on CPU).
  chunking    Comet's costs of decomposing the expert GEMMs (one GPU, Mixtral 8x7B shape, 16k rows):
              the first GEMM as C row chunks vs one call (C = 1, 2, 4, 8), the second GEMM as C column
              blocks of d vs one expert-major call, and the layer's forward+backward under each
              schedule on a 1x1 mesh (no communication to hide there: the schedules' overhead alone).
  train_step  tokens/s of the BERT-MoE training step (`moejax.train.trainer.Trainer`): forward,
              backward and LAMB update of random tokens, timed as the scaling study times it
              (`moejax.study.measure.time_training_step`).

  python benchmarks/gpu_suite.py --step=ceilings --out=/tmp/suite
  python benchmarks/gpu_suite.py --step=layer --out=/tmp/suite --smoke   # CPU: tiny, interpreted

Every record holds the device, versions, shapes, every timing (seconds, `time_call`: one compiling
call, warm-up calls, then timed calls) and medians. It is rewritten as the step goes (status
'running'), so a step killed part-way leaves what it measured; at the end status is 'ok', or
'error' with the traceback (exit status 1). --smoke uses tiny shapes and few calls: it checks the
code paths on CPU and its numbers mean nothing.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform as host_platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `experiments` and `moejax` importable from the tree
  sys.path.insert(0, ROOT)

from experiments import bench_kernels  # noqa: E402
from moejax.cost import model as cost_model  # noqa: E402
from moejax.kernels.tuning import time_call  # noqa: E402
from moejax.moe import experts as experts_lib  # noqa: E402
from moejax.moe import layer as layer_lib  # noqa: E402
from moejax.moe.config import MoEConfig  # noqa: E402
from moejax.runtime import mesh as mesh_lib  # noqa: E402
from moejax.runtime import platform as platform_lib  # noqa: E402
from moejax.study import phase_timing  # noqa: E402
from moejax.train import presets  # noqa: E402

STEPS = ('env', 'ceilings', 'kernels', 'layer', 'chunking', 'train_step')
OPTIONAL_PACKAGES = ('ml_collections', 'tensorboardX', 'tokamax')
ROWS = 16384  # routed rows (token-choices) of the kernel and layer benchmarks

# Expert shapes for the kernel benchmark. 'experts': experts on the one GPU (expert parallelism 1).
KERNEL_MODELS = {
    'mixtral_8x7b': bench_kernels.MODELS['mixtral_8x7b'],
    'qwen2_moe': bench_kernels.MODELS['qwen2_moe'],
    'smile_3.7b_e8': dict(bench_kernels.MODELS['smile_3.7b'], experts=8),
}
SMOKE_KERNEL_MODELS = {'smoke_gated_e8': dict(d=32, f=64, experts=8, top_k=2, gated=True, activation='silu')}

# The same models as MoE layers: tokens * top_k = ROWS routed rows.
LAYER_MODELS = {
    'mixtral_8x7b': dict(d_model=4096, d_ff=14336, num_experts=8, top_k=2, gated=True, activation='silu',
                         tokens=ROWS // 2),
    'qwen2_moe': dict(d_model=2048, d_ff=1408, num_experts=64, top_k=4, gated=True, activation='silu',
                      tokens=ROWS // 4),
    'smile_3.7b_e8': dict(d_model=768, d_ff=3072, num_experts=8, top_k=1, gated=False, activation='gelu',
                          tokens=ROWS),
}
# The published fine-grained layers (moejax.train.presets) at full width: Qwen3-MoE's 128 experts, and a quarter of
# DeepSeek-V3's 256 (their weights, 5.6 GB in bf16, fit one GPU with the backward's), with V3's sigmoid, group-limited
# routing and shared expert; the balance loss per call (the benchmark's x is [tokens, d], not sequences).
for _name, _experts in (('qwen3_moe', 1), ('deepseek_v3', 4)):
  _fields = presets.moe_fields(_name, expert_scale=_experts)
  LAYER_MODELS[_name] = dict(_fields, balance_loss='batch', tokens=ROWS // _fields['top_k'])
SMOKE_LAYER_MODELS = {
    'smoke_gated_e8': dict(d_model=32, d_ff=64, num_experts=8, top_k=2, gated=True, activation='silu', tokens=32),
}

CHUNKS = (1, 2, 4, 8)  # chunking: pieces of the decomposed GEMMs

# A small BERT-MoE (every other FFN an MoE layer, as in SMILE) and its batch.
TRAIN_SHAPE = dict(vocab_size=32768, num_layers=4, d_model=768, num_heads=12, d_ff=3072, seq_len=512, batch=32,
                   num_experts=8, top_k=2)
SMOKE_TRAIN_SHAPE = dict(vocab_size=128, num_layers=2, d_model=32, num_heads=2, d_ff=64, seq_len=16, batch=4,
                         num_experts=4, top_k=2)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--step', required=True, choices=STEPS)
  p.add_argument('--out', required=True, help='Directory of the JSON files (created if missing).')
  p.add_argument('--smoke', action='store_true', help='Tiny shapes and few calls (CPU, interpreted Pallas).')
  p.add_argument('--warmup', type=int, default=None, help='Untimed calls after compiling (default 5; smoke 1).')
  p.add_argument('--iters', type=int, default=None, help='Timed calls (default 30; smoke 3).')
  p.add_argument('--gemm_sizes', default='4096,8192,16384', help='ceilings: square GEMM sizes (smoke: 256).')
  p.add_argument('--copy_mib', type=int, default=1024, help='ceilings: MiB copied (smoke: 4).')
  p.add_argument('--kernel_models', default=','.join(KERNEL_MODELS), help=f'kernels: subset of {list(KERNEL_MODELS)}.')
  p.add_argument('--kernel_rows', default=str(ROWS), help='kernels: routed rows R (comma-separated).')
  p.add_argument('--kernel_ops', default='gmm,ffn', help='kernels: gmm and/or ffn.')
  p.add_argument('--kernel_impls', default=','.join(bench_kernels.IMPLS), help='kernels: implementations.')
  p.add_argument('--kernel_warmup', type=int, default=3, help='kernels: untimed calls (smoke: 1).')
  p.add_argument('--kernel_iters', type=int, default=20, help='kernels: timed calls (smoke: 3).')
  p.add_argument('--layer_models', default=','.join(LAYER_MODELS), help=f'layer: subset of {list(LAYER_MODELS)}.')
  p.add_argument('--layer_backends', default='ragged_dot,pallas', help='layer: expert backends.')
  p.add_argument('--train_backends', default=None,
                 help='train_step: expert backends (default ragged_dot,pallas; smoke: ragged_dot, since the '
                 'interpreted Pallas step takes long to compile and the layer step already runs it).')
  p.add_argument('--dtype', default=None, choices=('bfloat16', 'float32'),
                 help='layer and train_step compute dtype (default: bfloat16 on GPU, float32 elsewhere).')
  args = p.parse_args(argv)
  if args.warmup is None:
    args.warmup = 1 if args.smoke else 5
  if args.iters is None:
    args.iters = 3 if args.smoke else 30
  if args.train_backends is None:
    args.train_backends = 'ragged_dot' if args.smoke else 'ragged_dot,pallas'
  if args.smoke:
    args.kernel_warmup, args.kernel_iters = 1, 3
  return args


def split(value: str) -> list[str]:
  return [v for v in value.split(',') if v]


def timing(times: list[float]) -> dict:
  """Every timed call (seconds), their median and minimum."""
  return {'times_s': list(times), 'median_s': statistics.median(times), 'min_s': min(times)}


def package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def versions() -> dict:
  import jaxlib  # pylint: disable=import-outside-toplevel
  out = {'python': host_platform.python_version(), 'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
         'numpy': np.__version__}
  for name in ('flax', 'optax', 'orbax-checkpoint', *OPTIONAL_PACKAGES):
    out[name] = package_version(name)
  return out


def utc_now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


class Record:
  """OUT/<step>.json, rewritten (atomically) on every `save`."""

  def __init__(self, out_dir: str, step: str, args: argparse.Namespace):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, f'{step}.json')
    self.start = time.perf_counter()
    device = jax.devices()[0]
    self.data = {'step': step, 'status': 'running', 'smoke': args.smoke, 'device': device.device_kind,
                 'platform': device.platform, 'device_count': jax.device_count(), 'versions': versions(),
                 'argv': sys.argv[1:], 'started_utc': utc_now()}

  def __setitem__(self, key, value):
    self.data[key] = value

  def __getitem__(self, key):
    return self.data[key]

  def setdefault(self, key, default):
    return self.data.setdefault(key, default)

  def save(self, status: str | None = None):
    if status is not None:
      self.data['status'] = status
      self.data['finished_utc'] = utc_now()
    self.data['wall_s'] = time.perf_counter() - self.start
    tmp = self.path + '.tmp'
    with open(tmp, 'w') as f:
      json.dump(self.data, f, indent=1, default=str)
    os.replace(tmp, self.path)


def say(*parts):
  print(f'[{time.strftime("%H:%M:%S")}]', *parts, flush=True)


# ----------------------------------------------------------------------------------------------- env


def nvidia_smi() -> dict:
  exe = shutil.which('nvidia-smi')
  if exe is None:
    return {'available': False, 'reason': 'nvidia-smi not on PATH'}
  fields = 'name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,pci.bus_id'
  out = {'available': True}
  for key, command in (('query', [exe, f'--query-gpu={fields}', '--format=csv']), ('full', [exe])):
    try:
      out[key] = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
      out[key] = f'{type(e).__name__}: {e}'
  return out


def step_env(args, rec: Record):
  del args
  rec['devices'] = [{'id': d.id, 'kind': d.device_kind, 'platform': d.platform, 'process_index': d.process_index}
                    for d in jax.devices()]
  rec['platform_version'] = getattr(getattr(jax.devices()[0], 'client', None), 'platform_version', None)
  rec['nvidia_smi'] = nvidia_smi()
  rec['environment_info'] = jax.print_environment_info(return_string=True)
  rec['env_vars'] = {k: v for k, v in os.environ.items() if k.startswith(('XLA_', 'JAX_', 'CUDA_', 'NVIDIA_'))
                     or k in ('PYTHONPATH',)}
  rec['python_executable'] = sys.executable
  rec['machine'] = {'system': host_platform.system(), 'machine': host_platform.machine(), 'cpus': os.cpu_count()}
  imports = {}
  for name in OPTIONAL_PACKAGES:
    try:
      imports[name] = getattr(__import__(name), '__version__', 'imported')
    except (Exception, Terminated) as e:  # pylint: disable=broad-except
      imports[name] = f'not importable: {type(e).__name__}: {e}'.splitlines()[0]
  rec['optional_imports'] = imports
  say(f"{rec['device']} ({rec['platform']}) x{rec['device_count']}; versions {rec['versions']}")
  say(f'optional packages: {imports}')


# ------------------------------------------------------------------------------------------ ceilings


def step_ceilings(args, rec: Record):
  sizes = [256] if args.smoke else [int(s) for s in split(args.gemm_sizes)]
  copy_bytes = (4 if args.smoke else args.copy_mib) * 2 ** 20
  gemm = []
  matmul = jax.jit(lambda a, b: a @ b)  # bf16 inputs and output; accumulation in fp32
  for n in sizes:
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    entry = {'m': n, 'n': n, 'k': n, 'dtype': 'bfloat16', 'flops': 2 * n ** 3,
             **timing(time_call(matmul, (a, b), args.warmup, args.iters))}
    entry['tflops'] = entry['flops'] / entry['median_s'] / 1e12
    gemm.append(entry)
    rec['gemm'] = gemm
    rec.save()
    say(f"gemm {n}^3 bf16: {entry['median_s'] * 1e3:.3f} ms, {entry['tflops']:.4g} TFLOP/s")
    del a, b
  best = max(gemm, key=lambda e: e['tflops'])
  rec['gemm_tflops'], rec['gemm_tflops_size'] = best['tflops'], best['n']

  x = jax.random.normal(jax.random.key(1), (copy_bytes // 2,), jnp.bfloat16)
  copies = []
  # Bytes counted: one read and one write of the buffer.
  for name, fn in (('copy', jax.jit(jnp.copy)), ('scale', jax.jit(lambda v: v * 2))):
    entry = {'kind': name, 'bytes': copy_bytes, 'bytes_moved': 2 * copy_bytes,
             **timing(time_call(fn, (x,), args.warmup, args.iters))}
    entry['gbps'] = entry['bytes_moved'] / entry['median_s'] / 1e9
    copies.append(entry)
    say(f"on-device {name} of {copy_bytes / 2 ** 20:.0f} MiB: {entry['median_s'] * 1e3:.3f} ms, "
        f"{entry['gbps']:.4g} GB/s (read + write)")
  devices = jax.devices()
  if len(devices) > 1:  # between two devices: bytes counted once
    put = lambda v: jax.device_put(v, devices[1])
    entry = {'kind': 'device_put_0_to_1', 'bytes': copy_bytes, 'bytes_moved': copy_bytes,
             **timing(time_call(put, (x,), args.warmup, args.iters))}
    entry['gbps'] = entry['bytes_moved'] / entry['median_s'] / 1e9
    copies.append(entry)
    say(f"device 0 -> 1 of {copy_bytes / 2 ** 20:.0f} MiB: {entry['gbps']:.4g} GB/s")
  rec['copy'] = copies
  rec['copy_gbps'] = max(e['gbps'] for e in copies if e['kind'] in ('copy', 'scale'))


# ------------------------------------------------------------------------------------------- kernels


def step_kernels(args, rec: Record) -> bool:
  """bench_kernels.run, one implementation of one case at a time so that the record grows as it goes."""
  if args.smoke:  # the whole FFN only: the interpreter makes every case cost seconds
    models, rows, ops = SMOKE_KERNEL_MODELS, [64], ['ffn']
  else:
    models, rows = {m: KERNEL_MODELS[m] for m in split(args.kernel_models)}, [int(r) for r in split(args.kernel_rows)]
    ops = split(args.kernel_ops)
  impls = split(args.kernel_impls)
  dtype = jnp.bfloat16
  rec.data.update(models=models, rows=rows, ops=ops, impls=impls, dtype='bfloat16', warmup=args.kernel_warmup,
                  iters=args.kernel_iters, interpret=platform_lib.pallas_interprets(jax.devices()[0].platform))
  results = []
  rec['results'] = results
  for name, model in models.items():
    for r in rows:
      for skew in ('balanced', 'skewed'):
        for op in ops:
          for impl in impls:  # both passes of one implementation per call
            results.extend(bench_kernels.run({name: model}, [r], [skew], [op], [impl], dtype, args.kernel_warmup,
                                             args.kernel_iters))
            rec.save()
  rec['summary'] = bench_kernels.summary(results, impls).splitlines()
  print('\nmedian ms (useful TFLOP/s)\n' + '\n'.join(rec['summary']), flush=True)
  rec['skipped_cases'] = sum('skipped' in e for e in results)
  # A case skipped for a missing optional package or device is fine; any error fails the step.
  failed = [e for e in results if 'error' in e]
  rec['failed_cases'] = len(failed)
  table = backend_table(results, rec)
  path = os.path.join(args.out, BACKEND_TABLE)
  with open(path, 'w') as f:
    json.dump(table, f, indent=1)
  rec['backend_table'] = path
  for row in table['shapes']:
    say(f"fastest moejax backend {row['model']} R={row['rows']} {row['skew']} {row['passes']}: {row['fastest']} "
        f"({', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in row['candidates_median_s'].items())})")
  return not failed


BACKEND_TABLE = 'backend_table.json'


def backend_table(results: list[dict], rec: Record) -> dict:
  """Per FFN shape (model, d, f, experts, gated, activation, rows, skew) and pass: the median seconds of every
  moejax backend that ran (`bench_kernels.MOEJAX_BACKENDS`) and the fastest of them; the references
  (dense_capacity, torch_grouped_mm, dense_gemm) alongside, never chosen. What a per-shape
  expert_backend='auto' would read."""
  shape_keys = ('model', 'd', 'f', 'experts', 'gated', 'activation', 'rows', 'skew', 'passes')
  rows = {}
  for e in results:
    if e['op'] != 'ffn':
      continue
    key = tuple(e[k] for k in shape_keys)
    row = rows.setdefault(key, {**dict(zip(shape_keys, key)), 'candidates_median_s': {}, 'references_median_s': {},
                                'not_measured': {}})
    if 'median_s' not in e:
      row['not_measured'][e['impl']] = e.get('skipped') or e.get('error')
    elif e['impl'] in bench_kernels.MOEJAX_BACKENDS:
      row['candidates_median_s'][e['impl']] = e['median_s']
    else:
      row['references_median_s'][e['impl']] = e['median_s']
  shapes = []
  for row in rows.values():
    candidates = row['candidates_median_s']
    row['fastest'] = min(candidates, key=candidates.get) if candidates else None
    shapes.append(row)
  return {'device': rec['device'], 'platform': rec['platform'], 'dtype': rec['dtype'], 'smoke': rec['smoke'],
          'versions': rec['versions'], 'source': os.path.basename(rec.path), 'op': 'ffn',
          'candidates': list(bench_kernels.MOEJAX_BACKENDS),
          'note': ("pallas = expert_backend='pallas' (the fused FFN); pallas_unfused = the FFN as separate Pallas "
                   "gmm calls (moejax.moe.experts.expert_hidden/expert_output with backend 'pallas'); medians "
                   "of the kernels step's timed calls"),
          'shapes': shapes}


# ------------------------------------------------------------------------------------------ chunking


def _pieces_program(pieces: int, by: str, backend: str):
  """One grouped matmul x [R, K] @ w [G, K, N] as `pieces` calls: contiguous row chunks (each with
  its own balanced groups) or column blocks of N; jitted."""
  def run(x, w):
    groups, rows = w.shape[0], x.shape[0]
    if by == 'rows':
      chunk = rows // pieces
      sizes = jnp.full((groups,), chunk // groups, jnp.int32)
      return jnp.concatenate([experts_lib.grouped_matmul(x[i * chunk:(i + 1) * chunk], w, sizes, backend)
                              for i in range(pieces)])
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    width = w.shape[2] // pieces
    return jnp.concatenate([experts_lib.grouped_matmul(x, w[:, :, i * width:(i + 1) * width], sizes, backend)
                            for i in range(pieces)], axis=1)
  return jax.jit(run)


def step_chunking(args, rec: Record):
  shape = SMOKE_LAYER_MODELS['smoke_gated_e8'] if args.smoke else LAYER_MODELS['mixtral_8x7b']
  shape = dict(shape)
  tokens = shape.pop('tokens')
  rows, d, f, groups = tokens * shape['top_k'], shape['d_model'], shape['d_ff'], shape['num_experts']
  dtype = compute_dtype(args)
  ceiling, source = read_ceiling(args.out)
  chunks, backends = ((1, 2), ['ragged_dot']) if args.smoke else (CHUNKS, split(args.layer_backends))
  rec.data.update(shape=shape, rows=rows, dtype=dtype, chunks=chunks, gemm_tflops=ceiling, mfu_reference=source,
                  xla_flags=os.environ.get('XLA_FLAGS', ''))
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (rows, d), dtype)
  h = jax.random.normal(keys[1], (rows, f), dtype)
  w_in = jax.random.normal(keys[2], (groups, d, f), dtype) / d ** 0.5
  w_out = jax.random.normal(keys[3], (groups, f, d), dtype) / f ** 0.5
  gemms = []
  rec['gemms'] = gemms
  for backend in backends:
    for gemm, by, operands in (('first_gemm', 'rows', (x, w_in)), ('second_gemm', 'columns', (h, w_out))):
      single = None
      for pieces in chunks:
        case = {'gemm': gemm, 'split': by, 'pieces': pieces, 'expert_backend': backend,
                **timing(time_call(_pieces_program(pieces, by, backend), operands, args.warmup, args.iters))}
        single = single or case['median_s']
        case['tflops'] = float(cost_model.matmul_flops(rows, d, f)) / case['median_s'] / 1e12
        case['time_vs_one_call'] = case['median_s'] / single
        gemms.append(case)
        say(f"{gemm} {backend} {pieces} {by} pieces: {case['median_s'] * 1e3:.3f} ms "
            f"({case['time_vs_one_call']:.3f}x one call, {case['tflops']:.1f} TFLOP/s)")
        rec.save()
  mesh = mesh_lib.make_mesh(1, 1)
  schedules = []
  rec['schedules'] = schedules
  for backend in backends:
    for schedule, pieces in (('sequential', 1), *(('chunked', c) for c in chunks[1:]),
                             *(('comet', c) for c in chunks)):
      cfg = MoEConfig(**shape, transport='padded', expert_backend=backend, dtype=dtype, schedule=schedule,
                      num_chunks=pieces)
      case = {'schedule': schedule, 'num_chunks': pieces, 'expert_backend': backend}
      case.update(_layer_case(cfg, tokens, mesh, args, ceiling, phases=False)[0])
      schedules.append(case)
      say(f"layer {backend} {schedule} C={pieces}: fwd {case['fwd']['median_s'] * 1e3:.3f} ms, "
          f"fwd+bwd {case['fwd_bwd']['median_s'] * 1e3:.3f} ms")
      rec.save()


# --------------------------------------------------------------------------------------------- layer


def read_ceiling(out_dir: str) -> tuple[float | None, str]:
  """(GEMM TFLOP/s, where from) of this run's ceilings step, or (None, why not)."""
  path = os.path.join(out_dir, 'ceilings.json')
  try:
    with open(path) as f:
      ceilings = json.load(f)
  except (OSError, ValueError) as e:
    return None, f'no ceilings from this run ({type(e).__name__}: {path})'
  if ceilings.get('status') != 'ok' or not ceilings.get('gemm_tflops'):
    return None, f"ceilings step status {ceilings.get('status')!r}"
  if ceilings.get('device') != jax.devices()[0].device_kind:
    return None, f"ceilings measured on {ceilings.get('device')!r}"
  return ceilings['gemm_tflops'], f"{path}: best bf16 GEMM (n={ceilings.get('gemm_tflops_size')})"


def expert_flops(cfg: MoEConfig, tokens: int) -> int:
  """Forward FLOPs of the expert matmuls on tokens x K rows (`moejax.cost.model.expert_flops`)."""
  return int(cost_model.expert_flops(tokens * cfg.choices_per_token, cfg.d_model, cfg.d_ff, cfg.gated))


def compute_dtype(args) -> str:
  return args.dtype or ('bfloat16' if jax.devices()[0].platform == 'gpu' else 'float32')


def _layer_case(cfg: MoEConfig, tokens: int, mesh, args, ceiling: float | None,
                phases: bool = True) -> tuple[dict, np.ndarray]:
  dtype = jnp.dtype(cfg.dtype)
  k_params, k_x, k_dy = jax.random.split(jax.random.key(0), 3)
  specs = layer_lib.param_specs(cfg)
  params = jax.tree.map(lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)),
                        layer_lib.init_params(k_params, cfg, dtype), specs)
  tokens_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(layer_lib.ALL))
  x = jax.device_put(jax.random.normal(k_x, (tokens, cfg.d_model), dtype), tokens_sharding)
  dy = jax.device_put(jax.random.normal(k_dy, (tokens, cfg.d_model), jnp.float32), tokens_sharding)

  forward = jax.jit(lambda p, v: layer_lib.moe_apply(p, v, cfg, mesh))

  def loss(p, v):
    y, aux = layer_lib.moe_apply(p, v, cfg, mesh)
    return jnp.sum(y.astype(jnp.float32) * dy) + aux['aux_loss']

  forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  case = {'fwd': timing(time_call(forward, (params, x), args.warmup, args.iters)),
          'fwd_bwd': timing(time_call(forward_backward, (params, x), args.warmup, args.iters))}
  y, aux = forward(params, x)
  case.update(tokens_dropped=int(aux['tokens_dropped']), tokens_overflowed=int(aux['tokens_overflowed']),
              expert_counts=np.asarray(aux['expert_counts']).tolist())
  flops = expert_flops(cfg, tokens)
  case.update(expert_flops_fwd=flops, expert_flops_fwd_bwd=3 * flops)
  rates = [('fwd', flops, case['fwd']['median_s']), ('fwd_bwd', 3 * flops, case['fwd_bwd']['median_s'])]
  if phases:
    case['phases_ms'] = phase_timing.measure_phases(params, x, cfg, mesh, args.warmup, args.iters)
    rates.append(('expert_phase', flops, case['phases_ms']['layer_expert_ms'] / 1e3))
  for name, useful, seconds in rates:
    case[f'tflops_{name}'] = useful / seconds / 1e12
    case[f'mfu_{name}'] = None if ceiling is None else case[f'tflops_{name}'] / ceiling
  return case, np.asarray(y, np.float32)


def step_layer(args, rec: Record):
  platform = jax.devices()[0].platform
  models = SMOKE_LAYER_MODELS if args.smoke else {m: LAYER_MODELS[m] for m in split(args.layer_models)}
  ceiling, source = read_ceiling(args.out)
  dtype = compute_dtype(args)
  rec.data.update(mesh='1x1', dtype=dtype, warmup=args.warmup, iters=args.iters, gemm_tflops=ceiling,
                  mfu_reference=source, models=models)
  say(f'MFU reference: {ceiling} TFLOP/s ({source})')
  mesh = mesh_lib.make_mesh(1, 1)
  cases, comparisons = [], []
  rec['cases'], rec['transport_comparison'] = cases, comparisons
  for name, shape in models.items():
    shape = dict(shape)
    tokens = shape.pop('tokens')
    for backend in split(args.layer_backends):
      outputs = {}
      for transport in ('ragged', 'padded'):
        cfg = MoEConfig(**shape, transport=transport, expert_backend=backend, dtype=dtype)
        case = {'model': name, 'tokens': tokens, 'rows': tokens * cfg.choices_per_token, **shape,
                'transport': transport, 'expert_backend': backend, 'dtype': dtype}
        if transport == 'ragged' and not platform_lib.has_ragged_all_to_all(platform):
          case['skipped'] = f'XLA:{platform.upper()} has no ragged all-to-all (moejax.runtime.platform)'
        else:
          measured, outputs[transport] = _layer_case(cfg, tokens, mesh, args, ceiling)
          case.update(measured)
          say(f"{name} {backend} {transport}: fwd {case['fwd']['median_s'] * 1e3:.3f} ms, fwd+bwd "
              f"{case['fwd_bwd']['median_s'] * 1e3:.3f} ms, expert phase {case['phases_ms']['layer_expert_ms']:.3f} "
              f"ms, MFU fwd {case['mfu_fwd']}, fwd+bwd {case['mfu_fwd_bwd']}")
        cases.append(case)
        rec.save()
      comparison = {'model': name, 'expert_backend': backend}
      if len(outputs) == 2:
        a, b = outputs['ragged'], outputs['padded']
        comparison.update(max_abs_diff=float(np.max(np.abs(a - b))),
                          rel_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
                          bitwise_equal=bool(np.array_equal(a, b)))
      else:
        comparison['skipped'] = 'ragged transport not run on ' + platform
      comparisons.append(comparison)
      say(f'ragged vs padded {name} {backend}: {comparison}')
      rec.save()
    overflow = _overflow_comparison(shape, tokens, dtype, mesh, platform)
    overflow['model'] = name
    rec.setdefault('overflow_comparison', []).append(overflow)
    say(f'ragged vs padded under buffer overflow {name}: {overflow}')
    rec.save()


OVERFLOW_BUFFER_FACTOR = 0.5  # on one device every row stays local: half of them overflow


def _overflow_comparison(shape: dict, tokens: int, dtype: str, mesh, platform: str) -> dict:
  """Forward outputs and overflow counts of 'ragged' and 'padded' with receive buffers too small."""
  out = {'buffer_factor': OVERFLOW_BUFFER_FACTOR, 'expert_backend': 'ragged_dot'}
  if not platform_lib.has_ragged_all_to_all(platform):
    out['skipped'] = 'ragged transport not run on ' + platform
    return out
  k_params, k_x = jax.random.split(jax.random.key(0))
  results = {}
  for transport in ('ragged', 'padded'):
    cfg = MoEConfig(**shape, transport=transport, expert_backend='ragged_dot', dtype=dtype,
                    buffer_factor=OVERFLOW_BUFFER_FACTOR)
    params = layer_lib.init_params(k_params, cfg, jnp.dtype(dtype))
    x = jax.random.normal(k_x, (tokens, cfg.d_model), jnp.dtype(dtype))
    y, aux = jax.jit(lambda p, v, cfg=cfg: layer_lib.moe_apply(p, v, cfg, mesh))(params, x)
    results[transport] = np.asarray(y, np.float32)
    out[f'tokens_overflowed_{transport}'] = int(aux['tokens_overflowed'])
    out[f'zero_rows_{transport}'] = int(np.sum(np.all(results[transport] == 0, axis=1)))
  a, b = results['ragged'], results['padded']
  out.update(max_abs_diff=float(np.max(np.abs(a - b))), bitwise_equal=bool(np.array_equal(a, b)),
             rel_err=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
  return out


# ---------------------------------------------------------------------------------------- train_step


def _train_run(args, shape: dict, model_cfg, moe_cfg: MoEConfig, mesh) -> dict:
  """Timings of the jitted training step (`moejax.study.measure.time_training_step`) on one random batch."""
  # Imported here: it needs ml_collections, which the other steps do not (a GPU machine may lack it).
  from moejax.study import measure  # pylint: disable=import-outside-toplevel

  timed = measure.time_training_step(model_cfg, moe_cfg, mesh, (1, shape['batch'], shape['seq_len']), 0, args.warmup,
                                     args.iters)
  run = {'expert_backend': moe_cfg.expert_backend, 'parameters': timed['parameters'], **timing(timed['times_s'])}
  run['tokens_per_s'] = shape['batch'] * shape['seq_len'] / run['median_s']
  run['losses'] = timed['losses']  # the compiling call's, the warm-up calls', then the timed calls'
  return run


def step_train(args, rec: Record):
  from moejax.train.model import ModelConfig  # pylint: disable=import-outside-toplevel

  shape = SMOKE_TRAIN_SHAPE if args.smoke else TRAIN_SHAPE
  dtype = compute_dtype(args)
  transport = platform_lib.flat_transport(jax.devices()[0].platform)
  mesh = mesh_lib.make_mesh(1, 1)
  model_cfg = ModelConfig(kind='bert', vocab_size=shape['vocab_size'], num_layers=shape['num_layers'],
                          d_model=shape['d_model'], num_heads=shape['num_heads'], d_ff=shape['d_ff'],
                          max_len=shape['seq_len'], dropout=0.1, moe_every=2, dtype=dtype)
  rec.data.update(shape=shape, model='bert', moe_every=2, dtype=dtype, transport=transport, mesh='1x1',
                  micro_batches=1, tokens_per_step=shape['batch'] * shape['seq_len'], warmup=args.warmup,
                  iters=args.iters)
  runs = []
  rec['runs'] = runs
  for backend in split(args.train_backends):
    moe_cfg = MoEConfig(num_experts=shape['num_experts'], top_k=shape['top_k'], d_model=shape['d_model'],
                        d_ff=shape['d_ff'], transport=transport, expert_backend=backend, activation='gelu',
                        dtype=dtype)
    run = _train_run(args, shape, model_cfg, moe_cfg, mesh)
    runs.append(run)
    rec.save()
    say(f"train step {backend}: {run['median_s'] * 1e3:.3f} ms, {run['tokens_per_s']:.4g} tokens/s, "
        f"loss {run['losses'][0]:.4g} -> {run['losses'][-1]:.4g}")


class Terminated(BaseException):
  """SIGTERM (e.g. from `timeout` in gpu_suite.sh): the step stops and its record says so. A
  BaseException, so that the per-case `except Exception` of bench_kernels.run lets it through."""


def _terminate(signum, frame):
  del frame
  raise Terminated(f'signal {signum}')


STEP_FUNCTIONS = {'env': step_env, 'ceilings': step_ceilings, 'kernels': step_kernels, 'layer': step_layer,
                  'chunking': step_chunking, 'train_step': step_train}


def main(argv=None) -> int:
  args = parse_args(argv)
  # absl flags (bench_kernels' and libraries' such as tokamax, which would otherwise parse sys.argv on
  # first use and reject this program's options) keep their defaults.
  flags.FLAGS.mark_as_parsed()
  rec = Record(args.out, args.step, args)
  say(f'step {args.step} on {rec["device"]} ({rec["platform"]}), smoke={args.smoke} -> {rec.path}')
  rec.save()
  signal.signal(signal.SIGTERM, _terminate)
  try:
    ok = STEP_FUNCTIONS[args.step](args, rec) is not False
  except (Exception, Terminated) as e:  # pylint: disable=broad-except
    rec['error'] = traceback.format_exc()
    rec.save('terminated' if isinstance(e, Terminated) else 'error')
    traceback.print_exc()
    say(f'step {args.step} FAILED after {rec["wall_s"]:.1f} s')
    return 1
  rec.save('ok' if ok else 'failed_cases')
  say(f'step {args.step} {rec["status"]} in {rec["wall_s"]:.1f} s')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
