"""Lina's setting (see `moejax.study.papers.lina`): its published numbers, Fig. 7's MoE layer and the
Transformer-XL step as `moejax.cost.contention` blocks, read off Fig. 7 or priced from sizes, and the two numbers fitted
on Fig. 7c."""

import dataclasses

import numpy as np

from moejax.cost import collectives, model, traffic
from moejax.cost import topology as topology_lib
from moejax.cost.contention import SYNC_ORDERS, Block, backward
from moejax.runtime import mesh as mesh_lib

D_MODEL, D_FF, LAYERS = 512, 2048, 12
TOP_K = 2  # Lina Sec. 7.1: top-2 gating in training
SEQ_LEN = 512  # assumed: Transformer-XL's enwik8 target length (Dai et al. 2019); Lina does not state it
BYTES = 4  # assumed fp32 (PyTorch 1.10 defaults); Lina does not state the precision
# Fig. 7 (Sec. 4.1) tick labels, ms: gradients ready at 4.1 and 5.7, A2A 5.7-13.3, FFN 13.3-14.9, A2A
# 14.9-22.5, gate 22.5-24.6 (7c); the all-reduce bucket of 3 gradients alone 24.6-30.4 (7c); overlapped (7a):
# the first A2A ends at 17.7 and the layer's gradients at 29.0.
FIG7 = {
  "ready_ms": (4.1, 5.7),
  "a2a_ms": 7.6,
  "ffn_ms": 1.6,
  "gate_ms": 2.1,
  "allreduce_ms": 5.8,
  "naive_a2a_end_ms": 17.7,
  "naive_end_ms": 29.0,
  "prioritized_end_ms": 24.6,
}
FIG3_MEDIAN, FIG3_WORST = 1.83, 4.14  # Sec. 2.2, Fig. 3: backward A2A slowdown under all-reduce overlap
FIG13 = {4: 2.21, 8: 2.39, 16: 2.31}  # Sec. 7.2, Fig. 13: backward A2A speedup (packing included)
FIG14 = {4: 1.36, 8: 1.41, 16: 1.42}  # Sec. 7.2, Fig. 14: priority + partitioning, no packing, step speedup
HEADLINE_MAX, HEADLINE_MEAN = 1.73, 1.57  # Abstract and Sec. 1 / Fig. 10: step speedup over DeepSpeed


def fig7_layer() -> list[Block]:
  """Fig. 7's MoE layer in seconds: compute to 4.1 ms (the bucket of 3 gradients ready), to 5.7, then
  A2A, FFN, A2A, gate. The zero-length all-to-alls only place the first two compute stretches."""
  first, second = FIG7["ready_ms"]
  ms = [
    Block(0.0, 0.0, first, FIG7["allreduce_ms"]),
    Block(0.0, 0.0, second - first, 0.0),
    Block(FIG7["a2a_ms"], FIG7["ffn_ms"], FIG7["gate_ms"], 0.0),
  ]
  return [Block(*(1e-3 * v for v in dataclasses.astuple(b))) for b in ms]


def fig7_blocks() -> tuple[list[Block], float]:
  """(blocks, forward seconds) of the 12-layer step with Fig. 7's per-layer times: dense compute 5.7 + 2.1
  ms, one 5.8 ms all-reduce per layer; the forward runs the two A2As and half the backward's compute."""
  block = Block(
    *(1e-3 * v for v in (FIG7["a2a_ms"], FIG7["ffn_ms"], FIG7["ready_ms"][1] + FIG7["gate_ms"], FIG7["allreduce_ms"]))
  )
  return [block] * LAYERS, LAYERS * (2 * block.a2a_s + (block.ffn_s + block.dense_s) / 2)


def mesh_of(experts: int) -> tuple[int, int]:
  """(nodes, gpus per node) for #GPUs = #experts, filling 4-GPU nodes first (assumed; Lina does not say)."""
  return max(experts // 4, 1), min(experts, 4)


def sizes_blocks(
  experts: int, tokens: float, gradient_bytes: float, topology=topology_lib.A100_IB100
) -> tuple[list[Block], float]:
  """(blocks, forward seconds) of the Transformer-XL step with `tokens` per GPU, uniform top-2 routing and
  `gradient_bytes` of each block's data-parallel gradient."""
  nodes, gpus = mesh_of(experts)
  rate, _ = model.default_rate(topology)
  rows = traffic.uniform_traffic(nodes, gpus, mesh_lib.AXES, 1) * (TOP_K * tokens / experts)
  a2a = collectives.all_to_all(
    rows * D_MODEL * BYTES, mesh_lib.same_group(mesh_lib.AXES, nodes, gpus), gpus, topology
  ).time_s
  ffn = float(model.expert_flops(TOP_K * tokens, D_MODEL, D_FF)) / rate  # forward; the backward costs twice
  dense = tokens * (8 * D_MODEL**2 + 4 * SEQ_LEN * D_MODEL) / rate
  allreduce = collectives.ring("all_reduce", gradient_bytes, nodes, gpus, topology).time_s
  block = Block(a2a_s=a2a, ffn_s=2 * ffn, dense_s=2 * dense, allreduce_s=allreduce)
  return [block] * LAYERS, LAYERS * (2 * a2a + ffn + dense)


def fitted_tokens(topology=topology_lib.A100_IB100) -> float:
  """Tokens per GPU at which the 16-expert backward all-to-all takes Fig. 7's 7.6 ms (affine in tokens)."""
  at = [sizes_blocks(16, t, 0.0, topology)[0][0].a2a_s for t in (1024.0, 2048.0)]
  return 1024.0 + (FIG7["a2a_ms"] * 1e-3 - at[0]) * 1024.0 / (at[1] - at[0])


def fitted_gradient_bytes(topology=topology_lib.A100_IB100) -> float:
  """Bytes of a block's gradient at which the all-reduce of 3 of them on the 16-expert mesh takes Fig. 7c's 5.8 ms
  (the ring's time is affine in bytes)."""
  nodes, gpus = mesh_of(16)
  at = [collectives.ring("all_reduce", b, nodes, gpus, topology).time_s for b in (1e6, 2e6)]
  return 1e6 + (FIG7["allreduce_ms"] * 1e-3 / 3 - at[0]) * 1e6 / (at[1] - at[0])


def summary(blocks, forward_s: float) -> dict:
  """Step seconds per schedule, the all-to-all speedup of prioritized over naive_overlap and the
  slowdowns of the all-to-alls that overlap an all-reduce under naive_overlap."""
  runs = {s: backward(blocks, s) for s in SYNC_ORDERS}
  solo = np.asarray(runs["prioritized"].a2a_s)
  slowdown = np.asarray(runs["naive_overlap"].a2a_s)[solo > 0] / solo[solo > 0]
  return {
    "step_s": {s: forward_s + r.end_s for s, r in runs.items()},
    "a2a_speedup": sum(runs["naive_overlap"].a2a_s) / solo.sum(),
    "overlapped_slowdowns": slowdown[slowdown > 1],
  }
