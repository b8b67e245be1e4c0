"""What the kernel benchmarks time (experiments/bench_kernels.py, experiments/tune_kernels.py and the GPU suite's
kernels step, moejax/bench/gpu/kernels_step.py): the expert FFN cases (`kernel_cases`), its implementations in JAX
(`kernel_impls`) and PyTorch (`torch_ffn`), the fused FFN's kernels one by one (`kernel_parts`), and the timing
of each case (`kernels`)."""
