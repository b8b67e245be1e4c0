#!/usr/bin/env bash
# GPU benchmark suite: every step of experiments/gpu_suite.py (env, ceilings, kernels, layer, chunking, train_step,
# attention, decoder_step, compile_time, mixers) as a process of its own, each writing OUT_DIR/<step>.json (and
# OUT_DIR/<step>.log).
# A failing step is logged and the suite goes on; the exit status is non-zero if any step failed.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [--config.FIELD=VALUE ...]
#
# The options (fields of configs/gpu_suite.py, e.g. --config.smoke=True, or --config=FILE first) go to every step;
# OUT_DIR is each step's --workdir.
#
# Environment: STEPS (default "env ceilings kernels layer chunking train_step attention decoder_step compile_time
# mixers": which steps, in order),
# STEP_TIMEOUT (seconds per step, 0 = none; a step killed by it keeps what it had written),
# SUITE_TIMEOUT (seconds for all steps together, 0 = none: each step is limited to what is left, and
# steps that cannot start in time are recorded as failed), PYTHON (default python3).
# See benchmarks/README.md.
#
# Wheels to carry to a GPU machine without a package index. It has jax 0.11 (CUDA), flax, optax,
# orbax-checkpoint, tensorstore, absl-py, chex, pytest, matplotlib, sentencepiece, and with them
# numpy, PyYAML, protobuf, packaging, opt_einsum, etils, six, tqdm, jaxtyping, wadler_lindig and
# typing_extensions. Missing (from each wheel's METADATA):
#   grain 0.2.18              moejax.data imports it (the decoder_step and compile_time steps build a Trainer); needs
#     array_record 0.8.6, portpicker 1.6.0, and absl-py, cloudpickle, etils, numpy, protobuf (present)
#   ml_collections 1.1.0      needs absl-py, PyYAML                                (present)
#   tensorboardX 2.6.5        needs numpy, packaging, protobuf>=3.20               (present)
#   tokamax 0.0.17            needs absl-py, jax>=0.11.1, jaxlib, jaxtyping, tqdm (present), tensorboardX and:
#     einshape 1.0, qwix 0.1.8 (needs flax>=0.12, opt_einsum: present), immutabledict 4.3.1,
#     pydantic 2.14.3 (-> pydantic_core 2.50.4, a CPython 3.12 binary wheel; annotated_types 0.8.0;
#     typing_inspection 0.4.5; typing_extensions>=4.16, carried as 4.16.0 in case the machine's is older),
#     xprof 2.24.2 (`import tokamax` imports it; a 32 MB binary wheel, whose import needs fire 0.7.1 ->
#     termcolor 3.3.0, and etils, six, protobuf: present; its other requirements, duckdb, gviz-api,
#     cheroot and google-cloud-storage, are not imported by tokamax).
#   (tokamax 0.0.12 fails on jax 0.11 with "Mesh.__init__() got an unexpected keyword argument": it
#   calls Pallas Mosaic GPU's kernel(out_shape=...), which jax 0.11 renamed out_type; 0.0.13 and newer
#   use out_type.)
# torch is not carried: the kernels step's torch_grouped_mm case uses the machine's own (2.8 or newer with
# CUDA) and is recorded as skipped, with the reason, where there is none.
# Download them here (from the repository root; about 41 MB):
#   python3 -m pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 ml_collections==1.1.0 tensorboardX==2.6.5 tokamax==0.0.17 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1 pydantic==2.14.3 pydantic_core==2.50.4 annotated_types==0.8.0 typing_inspection==0.4.5 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 typing_extensions==4.16.0 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
# Install them there (before running the suite, in the same shell):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.

set -u -o pipefail

usage() {
  echo "usage: bash $0 OUT_DIR [--config.FIELD=VALUE ...] (e.g. --config.smoke=True)" >&2
  exit 2
}

[[ $# -ge 1 && "$1" != -* ]] || usage
OUT_DIR=$1
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-"env ceilings kernels layer chunking train_step attention decoder_step compile_time mixers"}
STEP_TIMEOUT=${STEP_TIMEOUT:-0}
SUITE_TIMEOUT=${SUITE_TIMEOUT:-0}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# XLA's latency-hiding scheduler, so that independent exchanges and matmuls (the chunked and comet
# schedules) may overlap on the GPU; recorded by the env step.
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true${XLA_FLAGS:+ $XLA_FLAGS}"

mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/suite_summary.txt"
: >"$SUMMARY"

say() { echo "[gpu_suite $(date -u +%H:%M:%S)] $*"; }

say "steps: $STEPS; out: $OUT_DIR; options: $*; python: $(command -v "$PYTHON")"
failed=()
suite_start=$SECONDS
for step in $STEPS; do
  limit=$STEP_TIMEOUT
  if [[ "$SUITE_TIMEOUT" != 0 ]]; then
    left=$((SUITE_TIMEOUT - (SECONDS - suite_start) - 20))  # 20 s for the kill and the summary
    if ((left < 10)); then
      say "step $step: not started, SUITE_TIMEOUT=${SUITE_TIMEOUT}s reached"
      failed+=("$step")
      printf '%-12s %6ss  %s\n' "$step" 0 "not started (SUITE_TIMEOUT)" >>"$SUMMARY"
      continue
    fi
    if [[ "$limit" == 0 ]] || ((left < limit)); then limit=$left; fi
  fi
  cmd=("$PYTHON" -m experiments.gpu_suite "$@" "--config.step=$step" "--workdir=$OUT_DIR")
  if [[ "$limit" != 0 ]]; then
    cmd=(timeout --kill-after=10 "$limit" "${cmd[@]}")
    say "step $step: start (limit ${limit}s)"
  else
    say "step $step: start"
  fi
  start=$SECONDS
  "${cmd[@]}" 2>&1 | tee "$OUT_DIR/$step.log"
  rc=${PIPESTATUS[0]}
  elapsed=$((SECONDS - start))
  if [[ $rc -eq 0 ]]; then
    say "step $step: ok in ${elapsed}s"
    status=ok
  else
    [[ $rc -eq 124 || $rc -eq 137 ]] && why=" (timed out after ${limit}s)" || why=""
    say "step $step: FAILED with exit status $rc$why in ${elapsed}s; log: $OUT_DIR/$step.log"
    failed+=("$step")
    status="failed rc=$rc$why"
  fi
  printf '%-12s %6ss  %s\n' "$step" "$elapsed" "$status" >>"$SUMMARY"
done

say "done in $((SECONDS - suite_start))s:"
cat "$SUMMARY"
if [[ ${#failed[@]} -gt 0 ]]; then
  say "failed steps: ${failed[*]}"
  exit 1
fi
say "all steps ok; results in $OUT_DIR"
