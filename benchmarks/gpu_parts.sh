#!/usr/bin/env bash
# The GPU suite in parts that each finish within a limited command time (default 570 s): run
#   bash benchmarks/gpu_parts.sh OUT_DIR PART      (PART = 1 to 9, in that order; or "all")
# Each part is benchmarks/gpu_suite.sh on a subset of the steps and shapes, into OUT_DIR/part<PART>/, with
# SUITE_TIMEOUT=$PART_TIMEOUT (a step running long is stopped with what it had measured). Parts 3, 4 and 8 time
# against part 1's GEMM ceiling (its ceilings.json is copied in first). What each part runs:
#   1  env, ceilings, kernels at Mixtral 8x7B: ours (pallas, pallas_saved, pallas_unfused), the padded einsum, torch's
#      grouped GEMM and the dense GEMM (gmm, ffn and the fused FFNs' parts)
#   2  the same kernels at Qwen2-MoE, Qwen3-MoE and SMILE 3.7B (E 8)
#   3  layer at SMILE 3.7B (E 8), Qwen2-MoE and Mixtral 8x7B
#   4  layer at Qwen3-MoE and DeepSeek-V3 (a quarter of its experts), chunking, train_step
#   5  the tgmm (weight-gradient) tiles re-tuned with block_k up to 128: kernels/tuning.py's tgmm entries
#      (64/32, 128, 128) were never in a measured sweep (experiments/tune_kernels.py; OUT_DIR/part5/)
#   6  attention at DeepSeek-V3's (MLA) and Qwen3-MoE's (GQA) shapes, 4096 tokens: cuDNN, XLA and tokamax against the
#      materialised attention (MFU against part 1's GEMM ceiling where part 1 ran)
#   7  the whole expert FFN through the libraries at all four shapes: jax.lax.ragged_dot, tokamax and FP8 (qwix)
#   8  decoder_step: a Qwen3-MoE-shaped decoder's training step (as many layers as fit, at 128 and 32 experts), with
#      XLA's memory pool at 92% of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set)
#   9  compile_time: the train step's compile time on one GPU, tiny Qwen3-MoE and DeepSeek-V3 decoders at 8 and 32
#      layers, scanned and unrolled (no ceiling needed); mixers: Qwen3-Next's gated DeltaNet (moejax/bench/gpu/mixers.py)
# Afterwards `python -m experiments.expert_table --workdir=moejax/cost/expert_tables
# --config.records=OUT_DIR/part1/kernels.json,OUT_DIR/part2/kernels.json,OUT_DIR/part7/kernels.json` makes the table
# expert_backend='auto' reads. Environment: PART_TIMEOUT (seconds per part, default 570), PYTHON; options after PART
# (fields of configs/gpu_suite.py, --config.FIELD=VALUE) go to every step of parts 1 to 4 and 6 to 9.

set -u -o pipefail
[[ $# -ge 2 ]] || { echo "usage: bash $0 OUT_DIR PART(1-9|all) [--config.FIELD=VALUE ...]" >&2; exit 2; }
OUT_DIR=$1
PART=$2
shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export SUITE_TIMEOUT=${PART_TIMEOUT:-570}
OURS=pallas,pallas_saved,pallas_unfused,dense_capacity,torch_grouped_mm,dense_gemm  # parts 1 and 2
LIBRARIES=ragged_dot,tokamax,fp8  # part 7

copy_ceiling() {  # part 1's GEMM ceiling into $1, for the MFU; required unless $2 is "optional"
  if [[ -f "$OUT_DIR/part1/ceilings.json" ]]; then
    cp "$OUT_DIR/part1/ceilings.json" "$1/"
  elif [[ ${2:-} != optional ]]; then
    echo "part $part: no $OUT_DIR/part1/ceilings.json (run part 1 first: the MFU needs the GEMM ceiling)" >&2
    return 2
  fi
}

run_part() {
  local part=$1
  local dir="$OUT_DIR/part$part"
  mkdir -p "$dir" || exit 2
  case $part in
    1) STEPS="env ceilings kernels" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.kernel_models=mixtral_8x7b \
         --config.kernel_impls=$OURS "$@" ;;
    2) STEPS="kernels" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.kernel_models=qwen2_moe,qwen3_moe,smile_3.7b_e8 \
         --config.kernel_impls=$OURS "$@" ;;
    3|4)
      copy_ceiling "$dir" || return 2
      if [[ $part == 3 ]]; then
        STEPS="layer" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.layer_models=smile_3.7b_e8,qwen2_moe,mixtral_8x7b "$@"
      else
        STEPS="layer chunking train_step" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" \
          --config.layer_models=qwen3_moe,deepseek_v3 "$@"
      fi ;;
    5) PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=10 "$SUITE_TIMEOUT" \
         "${PYTHON:-python3}" -m experiments.tune_kernels --workdir="$dir" --config.kernels=tgmm \
         --config.block_m=32,64 --config.block_n=128,256 --config.block_k=64,128 --config.num_warps=8 \
         --config.num_stages=3,4 2>&1 | tee "$dir/tune_kernels.log"
       return "${PIPESTATUS[0]}" ;;
    6) copy_ceiling "$dir" optional
       STEPS="attention" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.attention_models=deepseek_v3,qwen3_moe "$@" ;;
    7) STEPS="kernels" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" \
         --config.kernel_models=mixtral_8x7b,qwen2_moe,qwen3_moe,smile_3.7b_e8 --config.kernel_impls=$LIBRARIES \
         --config.kernel_ops=ffn "$@" ;;
    8) copy_ceiling "$dir" || return 2
       XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92} STEPS="decoder_step" \
         bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.decoder_experts=128,32 "$@" ;;
    9) STEPS="compile_time mixers" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" "$@" ;;
    *) echo "PART must be 1 to 9 or all; got $part" >&2; return 2 ;;
  esac
}

if [[ $PART == all ]]; then
  status=0
  for p in 1 2 3 4 5 6 7 8 9; do run_part "$p" "$@" || status=1; done
  exit $status
fi
run_part "$PART" "$@"
