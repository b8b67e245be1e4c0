"""Where the fused expert FFN's time goes: each of its kernels timed alone (`kernels.ffn`).

Forward: 'hidden' (h = act(x w_gate) * (x w_in): the gated FFN's two matmuls, kernel 'ffn_in') and 'out'
(y = h w_out, 'gmm'). Backward: 'bwd_hidden' (dh = dy w_out^T with the recomputed pre-activations, 'ffn_bwd'),
'bwd_dx' (dx = dz_gate w_gate^T + dz_in w_in^T, 'ffn_in' with transposed weights), and the weight gradients
'bwd_dw_in', 'bwd_dw_gate', 'bwd_dw_out' (one 'tgmm' each). Each part's useful TFLOP/s (2 R d f per matmul) beside
the dense GEMM's says which kernel loses; their sum beside the fused forward+backward says what the glue costs.
The recompute is part of 'bwd_hidden' (its z_in and z_gate): 'pallas_unfused' in bench_kernels keeps h instead.
The FFN that keeps its pre-activations (expert_backend='pallas_saved') has two kernels of its own: 'hidden_saved'
(the forward's first kernel, also writing z_in and z_gate) and 'bwd_hidden_saved' (dh = dy w_out^T alone, the kept
pre-activations read in its epilogue); FFN_PARTS lists the parts each FFN runs.

  python -m experiments.bench_kernels --workdir=/tmp/parts --config.ops=parts --config.models=mixtral_8x7b \\
      --config.rows=16384
"""

import statistics

import jax
import jax.numpy as jnp

from kernels import backend, ffn
from kernels import gmm as gmm_lib
from kernels.gmm import tgmm_forward
from kernels.tuning import time_call
from moejax.bench.kernel_cases import group_sizes

# The parts of each fused FFN's forward and backward, in order (a plain FFN has no bwd_dw_gate).
FFN_PARTS = {
  "pallas": ("hidden", "out", "bwd_hidden", "bwd_dx", "bwd_dw_in", "bwd_dw_gate", "bwd_dw_out"),
  "pallas_saved": ("hidden_saved", "out", "bwd_hidden_saved", "bwd_dx", "bwd_dw_in", "bwd_dw_gate", "bwd_dw_out"),
}


def part_functions(model: dict, interpret: bool) -> dict:
  """name -> (fn(inputs) -> output, matmuls it does); inputs as `part_inputs` makes them."""
  opts = ffn.Options(model["activation"], None, interpret)
  gated = model["gated"]

  def hidden(a):
    return ffn.hidden(a["x"], a["w_in"], a["w_gate"], a["gs"], opts)

  def out(a):  # the fused forward's second kernel: gmm with its tiles
    return gmm_lib.gmm(a["h"], a["w_out"], a["gs"], interpret=interpret)

  def hidden_saved(a):
    return ffn.hidden_saving(a["x"], a["w_in"], a["w_gate"], a["gs"], opts)

  def bwd_hidden(a):
    return ffn.hidden_backward(a["dy"], a["x"], a["w_in"], a["w_out"], a["w_gate"], a["gs"], opts)

  def bwd_hidden_saved(a):
    return ffn.hidden_backward_saved(a["dy"], a["z_in"], a["z_gate"], a["w_out"], a["gs"], opts)

  def bwd_dx(a):
    return ffn.input_grad(a["dz_in"], a["dz_gate"], a["w_in"], a["w_gate"], a["gs"], opts)

  def tgmm(lhs, rhs):
    return lambda a: tgmm_forward(a[lhs], a[rhs], a["gs"], a["x"].dtype, None, interpret)

  parts = {
    "hidden": (hidden, 2 if gated else 1),
    "hidden_saved": (hidden_saved, 2 if gated else 1),
    "out": (out, 1),
    "bwd_hidden": (bwd_hidden, 3 if gated else 2),
    "bwd_hidden_saved": (bwd_hidden_saved, 1),
    "bwd_dx": (bwd_dx, 2 if gated else 1),
    "bwd_dw_in": (tgmm("x", "dz_in"), 1),
    "bwd_dw_out": (tgmm("h", "dy"), 1),
  }
  if gated:
    parts["bwd_dw_gate"] = (tgmm("x", "dz_gate"), 1)
  return parts


def part_inputs(model: dict, rows: int, sizes, dtype, seed: int = 0) -> dict:
  """Random x, weights, dy and the [R, f] intermediates (h, dz_in, dz_gate, z_in, z_gate) each part reads."""
  d, f, e = model["d"], model["f"], model["experts"]
  keys = jax.random.split(jax.random.key(seed), 10)
  normal = lambda k, shape, scale=1.0: (scale * jax.random.normal(k, shape)).astype(dtype)
  return {
    "x": normal(keys[0], (rows, d)),
    "w_in": normal(keys[1], (e, d, f), d**-0.5),
    "w_out": normal(keys[2], (e, f, d), f**-0.5),
    "w_gate": normal(keys[3], (e, d, f), d**-0.5) if model["gated"] else None,
    "dy": normal(keys[4], (rows, d)),
    "h": normal(keys[5], (rows, f)),
    "dz_in": normal(keys[6], (rows, f)),
    "dz_gate": normal(keys[7], (rows, f)) if model["gated"] else None,
    "z_in": normal(keys[8], (rows, f)),
    "z_gate": normal(keys[9], (rows, f)) if model["gated"] else None,
    "gs": jnp.asarray(sizes, jnp.int32),
  }


def run(name: str, model: dict, rows: int, skew: str, dtype, warmup: int, iters: int) -> list[dict]:
  """One result per part: median seconds and useful TFLOP/s (or 'error'); skew as kernel_cases.group_sizes."""
  sizes = group_sizes(rows, model["experts"], skew)
  inputs = part_inputs(model, rows, sizes, dtype)
  interpret = backend.use_interpret(None, inputs["x"])
  results = []
  for part, (fn, matmuls) in part_functions(model, interpret).items():
    flops = 2 * rows * model["d"] * model["f"] * matmuls
    entry = dict(
      model=name,
      **model,
      rows=rows,
      skew=skew,
      group_sizes=sizes.tolist(),
      op="parts",
      part=part,
      passes="bwd" if part.startswith("bwd") else "fwd",
      matmuls=matmuls,
      useful_flops=flops,
    )
    try:
      times = time_call(jax.jit(fn), (inputs,), warmup, iters)
      median = statistics.median(times)
      entry.update(times_s=times, median_s=median, tflops=flops / median / 1e12)
      timing = f"{median * 1e3:9.3f} ms {flops / median / 1e12:8.3g} TFLOP/s"
    except Exception as e:  # pylint: disable=broad-except  (recorded: one failing part must not lose the others)
      entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      timing = entry["error"][:60]
    results.append(entry)
    print(f"{name:14s} R={rows:6d} {skew:8s} {part:12s} {matmuls} matmul(s) {timing}", flush=True)
  return results
