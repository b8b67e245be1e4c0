"""One step of the GPU benchmark suite: measures, and writes every timing to <workdir>/<step>.json.

Steps (each meant to run as a process of its own; benchmarks/gpu_suite.sh runs them in order):
  env         device, driver (nvidia-smi), jax/jaxlib/flax versions, platform, optional packages.
  ceilings    bf16 dense GEMM TFLOP/s (square, several sizes) and on-device copy GB/s: the rates
              the other steps are judged against.
  kernels     the kernel benchmark (`moejax.bench.kernels.run`) at Mixtral 8x7B, Qwen2-MoE, Qwen3-MoE and SMILE 3.7B (E 8)
              expert shapes, 16k routed rows, balanced and skewed groups, gmm and the whole expert
              FFN, forward and forward+backward, every implementation bench_kernels knows (tokamax and
              torch._grouped_mm recorded as skipped, with the reason, where their package or CUDA is
              missing); each kernel of the fused FFN alone ('parts': moejax/bench/kernel_parts.py); and
              <workdir>/backend_table.json: per FFN shape and pass, the fastest moejax backend.
  layer       the MoE layer (`moejax.moe.layer.moe_apply`) on a 1x1 mesh: forward and
              forward+backward, the forward's phases (`moejax.study.phase_timing.measure_phases`),
              MFU of the expert FLOPs against this run's ceilings GEMM rate, and the outputs of the
              'ragged' and 'padded' collectives compared ('ragged' is skipped where XLA has no ragged
              all-to-all, e.g. on CPU).
  chunking    Comet's costs of decomposing the expert GEMMs (one GPU, Mixtral 8x7B shape, 16k rows):
              the first GEMM as C row chunks vs one call (C = 1, 2, 4, 8), the second GEMM as C column
              blocks of d vs one expert-major call, and the layer's forward+backward under each
              schedule on a 1x1 mesh (no communication to hide there: the schedules' overhead alone).
  train_step  tokens/s of the BERT-MoE training step (`moejax.train.trainer.Trainer`): forward,
              backward and LAMB update of random tokens, timed as the scaling study times it
              (`moejax.study.sweep_timing.time_training_step`).
  attention   causal self-attention (`moejax.models.attention.attend`) at DeepSeek-V3's MLA and Qwen3-MoE's GQA
              shapes, 4096 tokens, bf16: forward and forward+backward of cuDNN's fused kernel, XLA and tokamax
              against the materialised attention (times, TFLOP/s, temporary bytes, errors), and each over a KV
              cache (a prefill, a decode step) against XLA.
  decoder_step  tokens/s and MFU of the training step of a Qwen3-MoE-shaped decoder (published widths, AdamW with an
              fp32 master copy) on one device, at each expert count of config.decoder_experts with as many layers as
              fit the device's memory by the analytic count (moejax.study.memory); MFU against this run's ceilings.
  compile_time  the train step's trace + lower + compile seconds on one device against depth (config.compile_layers, 8
              and 32), layers scanned and unrolled, for configs/decoder.py's tiny families of config.compile_families:
              what scanning saves as a decoder deepens (the mechanism experiments/compile_time.py runs on CPU).
  mixers      Qwen3-Next's gated DeltaNet at Qwen3-Next-80B-A3B's shapes, one sequence of each of config.mixer_seq_lens
              (4096, 16384) tokens: moejax's chunked delta rule (chunks config.mixer_chunks), tokamax's chunked Kimi
              delta attention as the same rule (where installed) and the whole layer, forward and forward+backward
              (times, TFLOP/s of the chunked form, temporary bytes), each against the recurrent rule on a prefix.

  python -m experiments.gpu_suite --workdir=/tmp/suite --config.step=ceilings
  python -m experiments.gpu_suite --workdir=/tmp/suite --config.step=layer --config.smoke=True   # CPU: tiny, interpreted

Every record holds the device, versions, shapes, every timing (seconds, `time_call`: one compiling
call, warm-up calls, then timed calls) and medians. It is rewritten as the step goes (status
'running'), so a step killed part-way leaves what it measured; at the end status is 'ok', or
'error' with the traceback (exit status 1). config.smoke uses tiny shapes and few calls: it checks the
code paths on CPU and its numbers mean nothing.

Every option is a field of configs/gpu_suite.py. This module runs one step; the steps live in moejax/bench/gpu/ (one
module each, with `record.py`, the record they write, and `shapes.py`, what they time).
"""

import copy
import os
import signal
import sys
import traceback

from absl import flags

from moejax import cli
from moejax.bench.gpu.attention import step_attention
from moejax.bench.gpu.ceilings import step_ceilings
from moejax.bench.gpu.chunking import step_chunking
from moejax.bench.gpu.compile_time import check_sweep, step_compile_time
from moejax.bench.gpu.decoder_step import step_decoder
from moejax.bench.gpu.env import step_env
from moejax.bench.gpu.kernels_step import step_kernels
from moejax.bench.gpu.layer import step_layer
from moejax.bench.gpu.mixers import step_mixers
from moejax.bench.gpu.record import Record, Terminated, say
from moejax.bench.gpu.train_step import step_train
from moejax.validation import ConfigError, require

STEP_FUNCTIONS = {
  "env": step_env,
  "ceilings": step_ceilings,
  "kernels": step_kernels,
  "layer": step_layer,
  "chunking": step_chunking,
  "train_step": step_train,
  "attention": step_attention,
  "decoder_step": step_decoder,
  "compile_time": step_compile_time,
  "mixers": step_mixers,
}
STEPS = tuple(STEP_FUNCTIONS)


def resolved(config):
  """A copy of the suite's config, checked, with the defaults that depend on smoke filled in."""
  require(config.step in STEPS, "step", config.step, f"one of {list(STEPS)}")
  require(config.dtype in ("", "bfloat16", "float32"), "dtype", config.dtype, "'', bfloat16 or float32")
  if config.step == "compile_time":
    check_sweep(config.compile_families, config.compile_layers, config.compile_scan, prefix="compile_")
  config = copy.deepcopy(config)
  if config.warmup is None:
    config.warmup = 1 if config.smoke else 5
  if config.iters is None:
    config.iters = 3 if config.smoke else 30
  if not config.train_backends:
    config.train_backends = ("ragged_dot",) if config.smoke else ("ragged_dot", "pallas")
  if not config.decoder_backends:
    config.decoder_backends = ("ragged_dot",) if config.smoke else ("pallas",)
  if config.smoke:
    config.kernel_warmup, config.kernel_iters = 1, 3
  return config


def _terminate(signum, frame):
  del frame
  raise Terminated(f"signal {signum}")


def run_step(config, workdir: str) -> int:
  """Runs the config's step, writing <workdir>/<step>.json as it goes; the exit status (0: ok)."""
  config = resolved(config)
  rec = Record(workdir, config.step, config)
  say(f"step {config.step} on {rec['device']} ({rec['platform']}), smoke={config.smoke} -> {rec.path}")
  rec.save()
  signal.signal(signal.SIGTERM, _terminate)
  try:
    ok = STEP_FUNCTIONS[config.step](config, rec) is not False
  except (Exception, Terminated) as e:  # pylint: disable=broad-except
    rec["error"] = traceback.format_exc()
    rec.save("terminated" if isinstance(e, Terminated) else "error")
    traceback.print_exc()
    say(f"step {config.step} FAILED after {rec['wall_s']:.1f} s")
    return 1
  rec.save("ok" if ok else "failed_cases")
  say(f"step {config.step} {rec['status']} in {rec['wall_s']:.1f} s")
  return 0 if ok else 1


def main(argv):
  del argv
  try:
    status = run_step(flags.FLAGS.config, flags.FLAGS.workdir)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  sys.exit(status)


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "gpu_suite.py"),
    "Suite config file (configs/gpu_suite.py).",
  )
  cli.define_workdir("Directory of the JSON files (created if missing).")
  cli.run(main)
