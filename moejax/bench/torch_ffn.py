"""The expert FFN in PyTorch with `torch._grouped_mm`: the outside anchor of the kernel benchmark
(experiments/bench_kernels.py).

The same computation as the benchmark's other implementations (moejax.bench.kernel_impls), on the same grouped
row layout: rows of group g are contiguous and in group order, and
  y = (act(x @ w_gate[g]) * (x @ w_in[g])) @ w_out[g]   (gated), or  act(x @ w_in[g]) @ w_out[g],
or for op 'gmm' the single product x @ w_in[g]. `torch._grouped_mm(a [R, K], b [G, K, N], offs)` takes
offs = the cumulative group ends (int32 [G], offs[-1] <= R), bf16 in and out with fp32 accumulation,
on CUDA (sm90+). The weights are stored as torchtitan's MoE stores them, [G, out, in], and passed
transposed (`w.transpose(-2, -1)`: a column-major [G, in, out] view), the layout that MoE uses.

torch is imported inside the functions: importing this module (and the suite) needs no torch.
"""

import numpy as np

from moejax.bench.kernel_cases import useful_flops

ACTIVATIONS = ("silu", "gelu")  # gelu: the tanh form, as kernels.activations


def activation_fn(name: str):
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  if name == "silu":
    return F.silu
  if name == "gelu":
    return lambda z: F.gelu(z, approximate="tanh")
  raise ValueError(f"unknown activation {name!r}; known: {ACTIVATIONS}")


def grouped_mm_loop(a, b, offs):
  """Reference for torch._grouped_mm(a, b, offs): one plain matmul per group in a's dtype (as
  torchtitan's for-loop path); rows past offs[-1] give zeros. Runs on any device."""
  import torch  # pylint: disable=import-outside-toplevel

  out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
  start = 0
  for g, end in enumerate(offs.tolist()):
    if end > start:
      out[start:end] = a[start:end] @ b[g]
    start = end
  return out


def ffn(x, w_in, w_out, w_gate, offs, activation: str, op: str, grouped_mm):
  """The FFN (or for op 'gmm' the first product) with `grouped_mm(a, b, offs)` as the grouped matmul.
  Weights in torchtitan's layout: w_in, w_gate [G, f, d]; w_out [G, d, f]."""
  mm = lambda a, w: grouped_mm(a, w.transpose(-2, -1), offs)
  z_in = mm(x, w_in)
  if op == "gmm":
    return z_in
  act = activation_fn(activation)
  h = act(z_in) if w_gate is None else act(mm(x, w_gate)) * z_in
  return mm(h, w_out)


def make_inputs(model: dict, rows: int, op: str, device: str, dtype=None, seed: int = 0):
  """(x, w_in, w_out, w_gate, dy) with kernel_impls.make_inputs' scales (x, dy ~ N(0, 1); weights ~ N(0, 1/fan_in));
  w_out and w_gate None where the op or model has none."""
  import torch  # pylint: disable=import-outside-toplevel

  dtype = dtype or torch.bfloat16
  gen = torch.Generator(device=device).manual_seed(seed)
  d, f, g = model["d"], model["f"], model["experts"]

  def normal(shape, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

  x = normal((rows, d))
  w_in = normal((g, f, d), d**-0.5)
  w_out = normal((g, d, f), f**-0.5) if op == "ffn" else None
  w_gate = normal((g, f, d), d**-0.5) if op == "ffn" and model["gated"] else None
  dy = normal((rows, f if op == "gmm" else d))
  return x, w_in, w_out, w_gate, dy


def offsets(sizes, device: str):
  """torch._grouped_mm's offs: the cumulative group ends, int32."""
  import torch  # pylint: disable=import-outside-toplevel

  return torch.tensor(np.cumsum(np.asarray(sizes, np.int64)), dtype=torch.int32, device=device)


def _rel_err(ours, ref) -> float:
  errs = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(ours, ref)]
  return max(errs)


def run_once(params, dy, offs, activation, op, bwd, grouped_mm):
  """Output (and, with bwd, the gradients of x and the weights given the output cotangent dy)."""
  import torch  # pylint: disable=import-outside-toplevel

  x, w_in, w_out, w_gate = params
  leaves = [p for p in params if p is not None]
  if not bwd:
    with torch.no_grad():
      return [ffn(x, w_in, w_out, w_gate, offs, activation, op, grouped_mm)]
  for p in leaves:
    p.grad = None
    p.requires_grad_(True)
  y = ffn(x, w_in, w_out, w_gate, offs, activation, op, grouped_mm)
  y.backward(dy)
  return [y.detach()] + [p.grad for p in leaves]


def bench_one(op: str, bwd: bool, model: dict, rows: int, sizes, warmup: int, iters: int) -> dict:
  """moejax.bench.kernels.bench_one's entry for torch._grouped_mm on CUDA: every timed call (CUDA events around
  the call, then a synchronize), the median, useful TFLOP/s and the error (output, gradients) against
  grouped_mm_loop on the same inputs."""
  import torch  # pylint: disable=import-outside-toplevel

  try:
    return _measure(op, bwd, model, rows, sizes, warmup, iters)
  finally:
    torch.cuda.empty_cache()  # the case's tensors are gone: give their memory back for the JAX cases


def _measure(op, bwd, model, rows, sizes, warmup, iters) -> dict:
  import torch  # pylint: disable=import-outside-toplevel

  device = "cuda"
  x, w_in, w_out, w_gate, dy = make_inputs(model, rows, op, device)
  params = (x, w_in, w_out, w_gate)
  offs = offsets(sizes, device)

  def call():
    return run_once(params, dy, offs, model["activation"], op, bwd, torch._grouped_mm)  # pylint: disable=protected-access

  for _ in range(1 + warmup):  # the first call stands for the others' compilation
    call()
  torch.cuda.synchronize()
  times = []
  for _ in range(iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  median = float(np.median(times))
  ours = call()  # run_once leaves these gradients alone: it sets p.grad = None first
  ref = run_once(params, dy, offs, model["activation"], op, bwd, grouped_mm_loop)
  entry = dict(
    times_s=times,
    median_s=median,
    tflops=useful_flops(model, rows, op, bwd) / median / 1e12,
    rel_err_vs_loop=_rel_err(ours, ref),
    torch_version=torch.__version__,
    weight_layout="[G, out, in], passed transposed (torchtitan)",
    timer="torch.cuda.Event around each call, then torch.cuda.synchronize()",
  )
  return entry
