"""The kernel benchmark's cases (experiments/bench_kernels.py, the GPU suite's kernels step): the expert FFN shapes,
the group sizes of a skew, and the useful FLOPs a timing is divided by.

A case is a dict: d (model width), f (expert width), experts (groups on the benchmarked GPU), top_k, gated,
activation.
"""

import numpy as np

from kernels.activations import ACTIVATIONS
from moejax.cost import model as cost_model
from moejax.models import presets
from moejax.validation import ConfigError


def case(name: str, **changes) -> dict:
  """Published model `name`'s expert FFN (moejax.models.presets.PUBLISHED) as a case: all its experts on the one
  GPU (expert parallelism 1) unless `changes` say otherwise."""
  shape = presets.expert_shape(name)
  return {
    "d": shape["d_model"],
    "f": shape["d_ff"],
    "experts": shape["num_experts"],
    "top_k": shape["top_k"],
    "gated": shape["gated"],
    "activation": shape["activation"],
    **changes,
  }


MODELS = {
  "mixtral_8x7b": case("mixtral_8x7b"),
  # 64, not the published 60 routed experts: the shape benchmarks/results/2026-11-23-h100 and the expert table
  # moejax ships (moejax/cost/expert_tables) were measured at.
  "qwen2_moe": case("qwen2_moe", experts=64),
  "qwen3_moe": case("qwen3_moe"),  # Qwen3-30B-A3B
  "phi3.5_moe": case("phi3.5_moe"),
  "smile_3.7b": case("smile_3.7b", experts=presets.experts_per_device("smile_3.7b")),  # one GPU of SMILE's mesh
}
SMOKE_MODELS = {
  "smoke_gated": dict(d=32, f=64, experts=4, top_k=2, gated=True, activation="silu"),
  "smoke_plain": dict(d=32, f=64, experts=4, top_k=2, gated=False, activation="gelu"),
}
SHAPE_FORM = "D,F,EXPERTS,GATED,ACTIVATION, e.g. 16,32,2,1,silu"


def custom_model(shape) -> dict:
  """A case from `shape`, the config field shape's D,F,EXPERTS,GATED,ACTIVATION (strings or values); a ConfigError
  naming the field on anything else."""
  try:
    d, f, experts, gated, activation = shape
    model = dict(d=int(d), f=int(f), experts=int(experts), top_k=1, gated=bool(int(gated)), activation=activation)
  except ValueError as e:
    raise ConfigError(
      f"config field shape={','.join(map(str, shape))} is not allowed: {SHAPE_FORM} ({e})", "shape", shape, SHAPE_FORM
    ) from None
  if min(model["d"], model["f"], model["experts"]) < 1 or activation not in ACTIVATIONS:
    raise ConfigError(
      f"config field shape={','.join(map(str, shape))} is not allowed: D, F, EXPERTS positive, "
      f"ACTIVATION one of {list(ACTIVATIONS)}",
      "shape",
      shape,
      SHAPE_FORM,
    )
  return model


SKEWS = ("balanced", "skewed")


def group_sizes(rows: int, experts: int, skew: str) -> np.ndarray:
  """balanced: equal shares; skewed: Zipf(1.2) shares, so the first expert gets the most."""
  if skew not in SKEWS:
    raise ValueError(f"skew {skew!r}: one of {SKEWS}")
  if skew == "balanced":
    share = np.ones(experts)
  else:
    share = 1.0 / np.arange(1, experts + 1) ** 1.2
  sizes = np.floor(rows * share / share.sum()).astype(np.int32)
  sizes[0] += rows - sizes.sum()
  return sizes


def useful_flops(model, rows, op, bwd):
  """'gmm': one [R, d] x [d, f] matmul; 'ffn': the expert FFN (`moejax.cost.model.expert_flops`); x3 with the
  backward."""
  if op == "gmm":
    forward = cost_model.matmul_flops(rows, model["d"], model["f"])
  else:
    forward = cost_model.expert_flops(rows, model["d"], model["f"], model["gated"])
  return int(forward) * (3 if bwd else 1)  # exact: integers far below 2^53
