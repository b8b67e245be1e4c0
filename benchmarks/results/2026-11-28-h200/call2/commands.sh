# second GPU call of 2026-11-28: what the first call's budgeted run did not reach (ceilings, the steps that needed grain,
# the rest of the FFN table at Mixtral, cuDNN attention at DeepSeek-V3)
O=/tmp/gpu2; S="--config.warmup=2 --config.iters=10 --config.kernel_warmup=2 --config.kernel_iters=10 --config.kernel_skews=balanced"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
run() { local d=$O/$1 lim=$2 st=$3; shift 3; mkdir -p $d; cp $O/core/ceilings.json $d/ 2>/dev/null; SUITE_TIMEOUT=$lim STEPS=$st bash benchmarks/gpu_suite.sh $d $S "$@"; }
run core 40 ceilings
run ffn 75 kernels --config.kernel_models=mixtral_8x7b --config.kernel_ops=ffn --config.kernel_impls=pallas,fp8,torch_grouped_mm,dense_gemm
run attention 70 attention --config.attention_models=deepseek_v3 --config.attention_impls=materialized,cudnn
run decoder 110 decoder_step --config.decoder_experts=128
run compile 70 compile_time --config.compile_families=qwen3_moe
