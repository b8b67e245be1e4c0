"""One step of the GPU benchmark suite: measures, and writes every timing to OUT/<step>.json.

Steps (each meant to run as a process of its own; benchmarks/gpu_suite.sh runs them in order):
  env         device, driver (nvidia-smi), jax/jaxlib/flax versions, platform, optional packages.
  ceilings    bf16 dense GEMM TFLOP/s (square, several sizes) and on-device copy GB/s: the rates
              the other steps are judged against.
  kernels     experiments/bench_kernels.py (`run`) at Mixtral 8x7B, Qwen2-MoE, Qwen3-MoE and SMILE 3.7B (E 8)
              expert shapes, 16k routed rows, balanced and skewed groups, gmm and the whole expert
              FFN, forward and forward+backward, every implementation bench_kernels knows (tokamax and
              torch._grouped_mm recorded as skipped, with the reason, where their package or CUDA is
              missing); each kernel of the fused FFN alone ('parts': experiments/kernel_parts.py); and
              OUT/backend_table.json: per FFN shape and pass, the fastest moejax backend.
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

This module parses the options and runs one step; the steps live in benchmarks/suite/ (one module each, with
`record.py`, the record they write, and `shapes.py`, what they time).
"""

import argparse
import os
import signal
import sys
import traceback

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: make `benchmarks`, `experiments` and `moejax` importable from the tree
  sys.path.insert(0, ROOT)

from benchmarks.suite.ceilings import step_ceilings  # noqa: E402
from benchmarks.suite.chunking import step_chunking  # noqa: E402
from benchmarks.suite.env import step_env  # noqa: E402
from benchmarks.suite.kernels import step_kernels  # noqa: E402
from benchmarks.suite.layer import step_layer  # noqa: E402
from benchmarks.suite.record import Record, Terminated, say  # noqa: E402
from benchmarks.suite.shapes import KERNEL_MODELS, LAYER_MODELS, ROWS  # noqa: E402
from benchmarks.suite.train_step import step_train  # noqa: E402
from experiments.kernel_impls import IMPLS  # noqa: E402

STEPS = ('env', 'ceilings', 'kernels', 'layer', 'chunking', 'train_step')


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
  p.add_argument('--kernel_ops', default='gmm,ffn,parts', help="kernels: 'gmm', 'ffn', 'parts' (the fused FFN's "
                 "kernels one by one).")
  p.add_argument('--kernel_impls', default=','.join(IMPLS), help='kernels: implementations.')
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
