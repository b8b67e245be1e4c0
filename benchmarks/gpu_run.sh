#!/usr/bin/env bash
# The GPU suite in one short run that a rare, brief GPU lease can afford:
#   bash benchmarks/gpu_run.sh OUT_DIR [BUDGET_S] [--config.FIELD=VALUE ...]
# Runs the entries below in order of priority, each as benchmarks/gpu_suite.sh into OUT_DIR/<entry>/ (raw JSON written
# as it goes), each limited to its share of seconds and to what is left of BUDGET_S (default 540). An entry that
# ended (finished, failed or used its whole share) is marked OUT_DIR/<entry>/done; one cut short by the budget is not,
# so running the same command again on the same OUT_DIR resumes where the first run stopped. Fewer timed calls than the
# full suite (warmup 2, 10 timed; kernels balanced groups only); benchmarks/gpu_parts.sh is the full suite in parts.
# Entries after the first copy its ceilings.json (the GEMM rate the MFU columns are judged against).
#   core           ceilings, env
#   ffn            kernels at Mixtral 8x7B: the expert FFN through every implementation (ours, padded einsum,
#                  tokamax, FP8, torch's grouped GEMM, dense GEMM)
#   layer          the MoE layer at Mixtral 8x7B (pallas): forward, forward+backward, phases, MFU
#   attention      DeepSeek-V3's MLA, 4096 tokens: cuDNN and tokamax against the materialised one
#   decoder        a Qwen3-MoE-shaped decoder's training step at 128 experts, as many layers as fit
#   compile        the train step's compile time, tiny Qwen3-MoE at 8 and 32 layers, scanned and unrolled
#   ffn_shapes     the expert FFN at Qwen2-MoE, Qwen3-MoE and SMILE 3.7B (E 8)
#   attention_gqa  Qwen3-MoE's GQA, every attention implementation
#   mixers         Qwen3-Next's gated DeltaNet, 4096 and 16384 tokens: moejax's chunked rule (chunks 64, 128), tokamax's
#                  chunked Kimi delta attention as the same rule, the whole layer; each against the recurrent rule
# `python -m experiments.gpu_tables OUT_DIR` prints the tables and the targets from what the run wrote.
# Environment: PYTHON (default python3). Wheels for tokamax and qwix: see benchmarks/gpu_suite.sh.

set -u -o pipefail
[[ $# -ge 1 && "$1" != -* ]] || { echo "usage: bash $0 OUT_DIR [BUDGET_S] [--config.FIELD=VALUE ...]" >&2; exit 2; }
OUT_DIR=$1
shift
BUDGET=540
if [[ $# -ge 1 && "$1" != -* ]]; then
  [[ "$1" =~ ^[0-9]+$ ]] || { echo "BUDGET_S must be whole seconds; got '$1'" >&2; exit 2; }
  BUDGET=$1
  shift
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHORT=(--config.warmup=2 --config.iters=10 --config.kernel_warmup=2 --config.kernel_iters=10
  --config.kernel_skews=balanced)
FFN_IMPLS=pallas,pallas_saved,pallas_unfused,ragged_dot,dense_capacity,tokamax,fp8,torch_grouped_mm,dense_gemm
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}  # the decoder step fills the GPU
start=$SECONDS
mkdir -p "$OUT_DIR" || exit 2
say() { echo "[gpu_run $(date -u +%H:%M:%S)] $*"; }

entry() {  # NAME SHARE_S STEPS [OPTION ...]: one entry, unless done or out of budget
  local name=$1 share=$2 steps=$3
  shift 3
  local dir="$OUT_DIR/$name"
  if [[ -f "$dir/done" ]]; then
    say "$name: done earlier, skipped"
    return 0
  fi
  local left=$((BUDGET - (SECONDS - start)))
  if ((left < 30)); then
    say "$name: not started, ${left}s of the budget left"
    return 0
  fi
  local limit=$((share < left ? share : left))
  mkdir -p "$dir" || return 2
  [[ $name != core && -f "$OUT_DIR/core/ceilings.json" ]] && cp "$OUT_DIR/core/ceilings.json" "$dir/"
  say "$name: start ($steps, limit ${limit}s)"
  SUITE_TIMEOUT=$limit STEPS=$steps bash "$ROOT/benchmarks/gpu_suite.sh" "$dir" "${SHORT[@]}" "$@" "${EXTRA[@]}"
  # ended on its own, or used its own share: done; cut by the budget: left for the next run
  if ((limit == share || SECONDS - start < BUDGET - 25)); then
    date -u +%FT%TZ >"$dir/done"
  fi
  say "$name: ended after $((SECONDS - start))s of ${BUDGET}s"
}

EXTRA=("$@")
# Shares from the H200 run of 2026-11-28 (results/2026-11-28-h200): compiling dominates each case.
entry core 60 "ceilings env"
entry ffn 170 kernels --config.kernel_models=mixtral_8x7b --config.kernel_ops=ffn --config.kernel_impls=$FFN_IMPLS
entry layer 100 layer --config.layer_models=mixtral_8x7b --config.layer_backends=pallas
entry attention 70 attention --config.attention_models=deepseek_v3 --config.attention_impls=materialized,cudnn,tokamax
entry decoder 70 decoder_step --config.decoder_experts=128
entry compile 110 compile_time --config.compile_families=qwen3_moe
entry ffn_shapes 300 kernels --config.kernel_models=qwen2_moe,qwen3_moe,smile_3.7b_e8 --config.kernel_ops=ffn \
  --config.kernel_impls=$FFN_IMPLS
entry attention_gqa 120 attention --config.attention_models=qwen3_moe
entry mixers 90 mixers --config.mixer_models=qwen3_next_80b_a3b --config.mixer_seq_lens=4096,16384
say "run ended after $((SECONDS - start))s; entries done: $(cd "$OUT_DIR" && ls -d */done 2>/dev/null | tr '\n' ' ')"
