#!/usr/bin/env bash
# The GPU suite in parts that each finish within a limited command time (default 570 s): run
#   bash benchmarks/gpu_parts.sh OUT_DIR PART      (PART = 1 to 6, in that order; or "all")
# Each part is benchmarks/gpu_suite.sh on a subset of the steps and shapes, into OUT_DIR/part<PART>/, with
# SUITE_TIMEOUT=$PART_TIMEOUT (a step running long is stopped with what it had measured). Parts 3 and 4 time the
# layer against part 1's GEMM ceiling (its ceilings.json is copied in first). What each part runs:
#   1  env, ceilings, kernels at Mixtral 8x7B (every implementation, gmm, ffn and the fused FFN's parts)
#   2  kernels at Qwen2-MoE, Qwen3-MoE and SMILE 3.7B (E 8)
#   3  layer at SMILE 3.7B (E 8), Qwen2-MoE and Mixtral 8x7B
#   4  layer at Qwen3-MoE and DeepSeek-V3 (a quarter of its experts), chunking, train_step
#   5  the tgmm (weight-gradient) tiles re-tuned with block_k up to 128: kernels/tuning.py's tgmm entries
#      (64/32, 128, 128) were never in a measured sweep (experiments/tune_kernels.py; OUT_DIR/part5/)
#   6  attention at DeepSeek-V3's (MLA) and Qwen3-MoE's (GQA) shapes, 4096 tokens: cuDNN, XLA and tokamax against the
#      materialised attention (MFU against part 1's GEMM ceiling where part 1 ran)
# Afterwards `python -m experiments.expert_table --workdir=moejax/cost/expert_tables
# --config.records=OUT_DIR/part1/kernels.json,OUT_DIR/part2/kernels.json` makes the table expert_backend='auto'
# reads. Environment: PART_TIMEOUT (seconds per part, default 570), PYTHON; options after PART (fields of
# configs/gpu_suite.py, --config.FIELD=VALUE) go to every step of parts 1 to 4 and 6.

set -u -o pipefail
[[ $# -ge 2 ]] || { echo "usage: bash $0 OUT_DIR PART(1-6|all) [--config.FIELD=VALUE ...]" >&2; exit 2; }
OUT_DIR=$1
PART=$2
shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export SUITE_TIMEOUT=${PART_TIMEOUT:-570}

run_part() {
  local part=$1
  local dir="$OUT_DIR/part$part"
  mkdir -p "$dir" || exit 2
  case $part in
    1) STEPS="env ceilings kernels" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.kernel_models=mixtral_8x7b "$@" ;;
    2) STEPS="kernels" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.kernel_models=qwen2_moe,qwen3_moe,smile_3.7b_e8 "$@" ;;
    3|4)
      if [[ ! -f "$OUT_DIR/part1/ceilings.json" ]]; then
        echo "part $part: no $OUT_DIR/part1/ceilings.json (run part 1 first: the layer's MFU needs the GEMM ceiling)" >&2
        return 2
      fi
      cp "$OUT_DIR/part1/ceilings.json" "$dir/"
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
    6) if [[ -f "$OUT_DIR/part1/ceilings.json" ]]; then cp "$OUT_DIR/part1/ceilings.json" "$dir/"; fi
       STEPS="attention" bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" --config.attention_models=deepseek_v3,qwen3_moe "$@" ;;
    *) echo "PART must be 1 to 6 or all; got $part" >&2; return 2 ;;
  esac
}

if [[ $PART == all ]]; then
  status=0
  for p in 1 2 3 4 5 6; do run_part "$p" "$@" || status=1; done
  exit $status
fi
run_part "$PART" "$@"
