"""The GPU benchmark suite (experiments/gpu_suite.py runs one step; benchmarks/gpu_suite.sh every step, each in a
process of its own, passing its options to each).

  python -m experiments.gpu_suite --workdir=/tmp/suite --config.step=ceilings
  python -m experiments.gpu_suite --workdir=/tmp/suite --config.step=layer --config.smoke=True   # CPU: tiny
  bash benchmarks/gpu_suite.sh /tmp/suite --config.smoke=True --config.kernel_models=mixtral_8x7b

Fields left None (warmup, iters) or empty (train_backends, dtype) take the defaults their comments give, which
depend on smoke.
"""

import ml_collections

from moejax.bench.gpu import attention, mixers, shapes
from moejax.bench.gpu.shapes import ATTENTION_MODELS, ATTENTION_SEQ_LEN, KERNEL_MODELS, LAYER_MODELS, ROWS
from moejax.bench.kernel_impls import IMPLS


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # the step to run: env, ceilings, kernels, layer, chunking, train_step, attention, decoder_step, compile_time or
  # mixers
  config.step = ""
  config.smoke = False  # tiny shapes and few calls (CPU, interpreted Pallas)
  config.warmup = ml_collections.FieldReference(None, field_type=int)  # untimed calls after compiling (5; smoke 1)
  config.iters = ml_collections.FieldReference(None, field_type=int)  # timed calls (30; smoke 3)
  config.gemm_sizes = (4096, 8192, 16384)  # ceilings: square GEMM sizes (smoke: 256)
  config.copy_mib = 1024  # ceilings: MiB copied (smoke: 4)
  config.kernel_models = tuple(KERNEL_MODELS)  # kernels: a subset of moejax.bench.gpu.shapes.KERNEL_MODELS
  config.kernel_rows = (ROWS,)  # kernels: routed rows R
  config.kernel_skews = ("balanced", "skewed")  # kernels: group sizes, equal or Zipf-skewed
  config.kernel_ops = ("gmm", "ffn", "parts")  # kernels: 'gmm', 'ffn', 'parts' (the fused FFN's kernels one by one)
  config.kernel_impls = IMPLS  # kernels: implementations
  config.kernel_warmup = 3  # kernels: untimed calls (smoke: 1)
  config.kernel_iters = 20  # kernels: timed calls (smoke: 3)
  config.layer_models = tuple(LAYER_MODELS)  # layer: a subset of moejax.bench.gpu.shapes.LAYER_MODELS
  config.layer_backends = ("ragged_dot", "pallas")  # layer: expert backends
  # train_step: expert backends (() = ragged_dot,pallas; smoke: ragged_dot, since the interpreted Pallas step takes
  # long to compile and the layer step already runs it).
  config.train_backends = ()
  config.attention_models = tuple(ATTENTION_MODELS)  # attention: a subset of moejax.bench.gpu.shapes.ATTENTION_MODELS
  config.attention_seq_len = ATTENTION_SEQ_LEN  # attention: tokens of the one sequence (smoke: 32)
  config.attention_impls = attention.IMPLS  # attention: implementations (moejax/bench/gpu/attention.py)
  # decoder_step (moejax/bench/gpu/decoder_step.py): expert backends (() = pallas; smoke: ragged_dot, as train_step),
  # the expert counts (each with as many layers as fit), remat of every layer, and the share of the device's memory
  # limit the analytic count may fill.
  config.decoder_backends = ()
  config.decoder_experts = (128, 32)
  config.decoder_remat = "full"
  config.decoder_memory_fraction = 0.9
  # compile_time (moejax/bench/gpu/compile_time.py): configs/decoder.py's tiny families, the depths and the layers
  # scanned (True) and unrolled (False), in that order (smoke: qwen3_moe at 2 layers).
  config.compile_families = ("qwen3_moe", "deepseek_v3")
  config.compile_layers = (8, 32)
  config.compile_scan = (True, False)
  # mixers (moejax/bench/gpu/mixers.py): a subset of shapes.MIXER_MODELS, the sequence lengths, the chunked rule's
  # chunk sizes, the implementations, and the prefix checked against the recurrent rule (smoke: tiny, fixed).
  config.mixer_models = tuple(shapes.MIXER_MODELS)
  config.mixer_seq_lens = shapes.MIXER_SEQ_LENS
  config.mixer_chunks = shapes.MIXER_CHUNKS
  config.mixer_impls = mixers.IMPLS
  config.mixer_check_len = shapes.MIXER_CHECK_LEN
  config.dtype = ""  # layer, train_step and decoder_step compute dtype: bfloat16 or float32 ('' = bfloat16 on GPU, float32 elsewhere)
  return config
