"""The kernel benchmark's cases (experiments/bench_kernels.py, benchmarks/gpu_suite.py): the expert shapes, the
group sizes of a skew, and the useful FLOPs a timing is divided by."""

import numpy as np

from moejax.cost import model as cost_model

# experts: experts on the benchmarked GPU (all of them: expert parallelism 1, except SMILE).
MODELS = {
    'mixtral_8x7b': dict(d=4096, f=14336, experts=8, top_k=2, gated=True, activation='silu'),
    'qwen2_moe': dict(d=2048, f=1408, experts=64, top_k=4, gated=True, activation='silu'),
    'qwen3_moe': dict(d=2048, f=768, experts=128, top_k=8, gated=True, activation='silu'),  # Qwen3-30B-A3B
    'phi3.5_moe': dict(d=4096, f=6400, experts=16, top_k=2, gated=True, activation='silu'),
    'smile_3.7b': dict(d=768, f=3072, experts=1, top_k=1, gated=False, activation='gelu'),
}
SMOKE_MODELS = {
    'smoke_gated': dict(d=32, f=64, experts=4, top_k=2, gated=True, activation='silu'),
    'smoke_plain': dict(d=32, f=64, experts=4, top_k=2, gated=False, activation='gelu'),
}


def group_sizes(rows: int, experts: int, skew: str) -> np.ndarray:
  """balanced: equal shares; skewed: Zipf(1.2) shares, so the first expert gets the most."""
  if skew == 'balanced':
    share = np.ones(experts)
  else:
    share = 1.0 / np.arange(1, experts + 1) ** 1.2
  sizes = np.floor(rows * share / share.sum()).astype(np.int32)
  sizes[0] += rows - sizes.sum()
  return sizes


def useful_flops(model, rows, op, bwd):
  """'gmm': one [R, d] x [d, f] matmul; 'ffn': the expert FFN (`moejax.cost.model.expert_flops`); x3 with the
  backward."""
  if op == 'gmm':
    forward = cost_model.matmul_flops(rows, model['d'], model['f'])
  else:
    forward = cost_model.expert_flops(rows, model['d'], model['f'], model['gated'])
  return int(forward) * (3 if bwd else 1)  # exact: integers far below 2^53
