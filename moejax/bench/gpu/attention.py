"""The attention step: one layer's causal self-attention as the decoder families run it
(`moejax.models.attention.attend`) at DeepSeek-V3's MLA shape and Qwen3-30B-A3B's GQA shape
(`moejax.bench.gpu.shapes.ATTENTION_MODELS`), one sequence in bf16: forward and forward+backward of each
implementation against the materialised attention the models ran before, with useful TFLOP/s (and MFU against this
run's ceilings GEMM rate), the compiled program's temporary bytes, and each output's and gradient's error against the
materialised one; then, per implementation, a prefill over a KV cache and one decode step against 'xla'.

  materialized    the einsum attention moejax ran before: fp32 logits [B, H, S, S], key/value heads repeated
  xla             attend(impl='xla'): jax.nn.dot_product_attention's XLA path (its scores are materialised too)
  cudnn           attend(impl='cudnn'): cuDNN's fused flash attention (MLA's v zero-padded to q's width)
  cudnn_unpadded  MLA only: jax's internal cuDNN call with v at its own width (cuDNN >= 9.10 on Hopper; not public
                  API, which takes v of k's shape only): what the padding of 'cudnn' costs
  tokamax         attend(impl='tokamax'), where tokamax is installed

Useful FLOPs count the visible (causal) query-key pairs only: 2 (W + W_v) per pair and head forward, 3x that forward
and backward, so work on masked or padded entries shows as a lower rate. An implementation that cannot run here is
recorded as skipped with the reason; one that raises fails the step (status 'failed_cases') after the others ran.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels.tuning import time_call
from moejax.bench.gpu.layer import read_ceiling
from moejax.bench.gpu.record import Record, say, timing
from moejax.bench.gpu.shapes import ATTENTION_MODELS, SMOKE_ATTENTION_MODELS, SMOKE_ATTENTION_SEQ_LEN
from moejax.models import attention
from moejax.validation import require

IMPLS = ("materialized", "xla", "cudnn", "cudnn_unpadded", "tokamax")
DTYPE = "bfloat16"


class Skipped(Exception):
  """An implementation that cannot run on this machine, with the reason."""


def materialized(q_BxSxHxW, k_BxSxHxW, v_BxSxHxW, scale: float) -> jax.Array:
  """The attention moejax's models ran before `attend`: fp32 logits of every query-key pair, masked, softmax, the
  probabilities in v's dtype times v; key/value heads repeated to the query heads."""
  s, group = q_BxSxHxW.shape[1], q_BxSxHxW.shape[2] // k_BxSxHxW.shape[2]
  k_BxSxHxW, v_BxSxHxW = (jnp.repeat(a, group, axis=2) for a in (k_BxSxHxW, v_BxSxHxW))
  logits_BxHxSxS = jnp.einsum("bqhw,bkhw->bhqk", q_BxSxHxW, k_BxSxHxW, preferred_element_type=jnp.float32) * scale
  visible_SxS = jnp.tril(jnp.ones((s, s), bool))
  probs_BxHxSxS = jax.nn.softmax(jnp.where(visible_SxS, logits_BxHxSxS, -jnp.inf), axis=-1).astype(v_BxSxHxW.dtype)
  return jnp.einsum("bhqk,bkhw->bqhw", probs_BxHxSxS, v_BxSxHxW)


def implementation(impl: str, shape: dict, scale: float):
  """fn(q, k, v, query_positions=None) -> out of `impl` at `shape`; Skipped where it cannot run here."""
  device = jax.devices()[0]
  if impl == "materialized":
    return lambda q, k, v, positions=None: materialized(q, k, v, scale)
  if impl == "cudnn_unpadded":
    if shape["v_width"] == shape["width"]:
      raise Skipped("q/k and v equally wide: the same call as cudnn")
    why_not = attention.cudnn_refusal(DTYPE, shape["width"], False, device)
    if why_not:
      raise Skipped(why_not)
    try:
      from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise Skipped(f"jax's internal cuDNN attention does not import: {e}") from e

    def unpadded(q, k, v, positions=None):
      del positions  # training only
      try:
        return cudnn.dot_product_attention(q, k, v, scale=scale, mask_type=cudnn.MaskType.CAUSAL)
      except NotImplementedError as e:  # jax's check: cuDNN < 9.10, or before Hopper
        raise Skipped(f"cuDNN takes no v narrower than q here: {e}") from e

    return unpadded
  try:
    impl = attention.resolve_impl(impl, DTYPE, max(shape["width"], shape["v_width"]), device=device)
  except ValueError as e:  # ConfigError: why it cannot run here
    raise Skipped(str(e)) from e
  return lambda q, k, v, positions=None: attention.attend(q, k, v, impl, scale, query_positions_S=positions)


def inputs(shape: dict, seq_len: int, keys: int | None = None, seed: int = 0) -> tuple:
  """Random bf16 q [1, S, H, W], k [1, keys, H_kv, W], v [1, keys, H_kv, W_v] and a float32 output cotangent."""
  keys = keys or seq_len
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  dtype = jnp.dtype(DTYPE)
  return (
    jax.random.normal(kq, (1, seq_len, shape["heads"], shape["width"]), dtype),
    jax.random.normal(kk, (1, keys, shape["kv_heads"], shape["width"]), dtype),
    jax.random.normal(kv, (1, keys, shape["kv_heads"], shape["v_width"]), dtype),
    jax.random.normal(kd, (1, seq_len, shape["heads"], shape["v_width"]), jnp.float32),
  )


def useful_flops(shape: dict, seq_len: int) -> int:
  """Forward FLOPs of the visible pairs: q.k and p v, 2 (W + W_v) per (query, key) pair and head."""
  return 2 * shape["heads"] * seq_len * (seq_len + 1) // 2 * (shape["width"] + shape["v_width"])


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def compiled(fn, *args):
  """fn jitted and compiled for `args` (one compile serves the timing and the memory analysis)."""
  return jax.jit(fn).lower(*args).compile()


def temp_bytes(program) -> int | None:
  """A compiled program's temporary bytes (XLA's memory analysis), or None where the backend gives none."""
  analysis = program.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


def training_case(impl: str, shape: dict, seq_len: int, config, ceiling: float | None, reference: dict) -> dict:
  """Timings, rates, temporary bytes and errors of `impl`'s forward and forward+backward; `reference` holds the
  materialised outputs and gradients once the 'materialized' case (the first) has run."""
  scale = shape["width"] ** -0.5
  fn = implementation(impl, shape, scale)
  q, k, v, dout = inputs(shape, seq_len)
  forward = compiled(fn, q, k, v)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * dout)
  forward_backward = compiled(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, k, v)
  case = {
    "fwd": timing(time_call(forward, (q, k, v), config.warmup, config.iters)),
    "fwd_bwd": timing(time_call(forward_backward, (q, k, v), config.warmup, config.iters)),
    "temp_bytes_fwd": temp_bytes(forward),
    "temp_bytes_fwd_bwd": temp_bytes(forward_backward),
  }
  flops = useful_flops(shape, seq_len)
  case.update(flops_fwd=flops, flops_fwd_bwd=3 * flops)
  for passes in ("fwd", "fwd_bwd"):
    case[f"tflops_{passes}"] = case[f"flops_{passes}"] / case[passes]["median_s"] / 1e12
    case[f"mfu_{passes}"] = None if ceiling is None else case[f"tflops_{passes}"] / ceiling
  out = np.asarray(forward(q, k, v), np.float32)
  grads = [np.asarray(g, np.float32) for g in forward_backward(q, k, v)[1]]
  if impl == "materialized":
    reference.update(out=out, grads=grads)
  elif reference:
    case["rel_err_vs_materialized"] = {
      "out": rel_err(out, reference["out"]),
      **{f"d{n}": rel_err(g, r) for n, g, r in zip("qkv", grads, reference["grads"])},
    }
  return case


def decode_case(impl: str, shape: dict, seq_len: int, config, want: dict) -> dict:
  """`impl` over a KV cache of seq_len slots: a prefill of the first half (the other slots hold keys and values
  that must stay hidden), and one step at the next position, each against 'xla' (`want`, filled in by the 'xla'
  case, the first); the step's timing."""
  fn = implementation(impl, shape, shape["width"] ** -0.5)
  prefill = seq_len // 2
  q, k, v, _ = inputs(shape, prefill + 1, keys=seq_len, seed=1)
  call = jax.jit(lambda q, k, v, positions: fn(q, k, v, positions))
  args = {
    "prefill": (q[:, :prefill], k, v, jnp.arange(prefill)),
    "step": (q[:, prefill:], k, v, jnp.arange(1) + prefill),
  }
  outs = {part: np.asarray(call(*a), np.float32) for part, a in args.items()}
  case = {
    "cache_len": seq_len,
    "prefill": prefill,
    "step": timing(time_call(call, args["step"], config.warmup, config.iters)),
  }
  if impl == "xla":
    want.update(outs)
  else:
    case["rel_err_vs_xla"] = {part: rel_err(outs[part], want[part]) for part in outs}
  return case


def run_case(rec: Record, kind: str, case: dict, measure) -> bool:
  """Adds `case` with what `measure()` returns (or why it was skipped, or the error) to rec[kind]; False on error."""
  try:
    case.update(measure())
  except Skipped as e:
    case["skipped"] = str(e)
  except Exception:  # pylint: disable=broad-except  # recorded; the other implementations still run
    case["error"] = traceback.format_exc()
  rec[kind].append(case)
  rec.save()
  timed = " ".join(f"{p} {case[p]['median_s'] * 1e3:.3f} ms" for p in ("fwd", "fwd_bwd", "step") if p in case)
  say(
    f"{kind} {case['model']} {case['impl']}: {case.get('skipped') or timed or case['error'].strip().splitlines()[-1]}"
    f"{' ' + str(case.get('rel_err_vs_materialized') or case.get('rel_err_vs_xla') or '')}"
  )
  return "error" not in case


def step_attention(config, rec: Record):
  require(
    set(config.attention_models) <= set(ATTENTION_MODELS),
    "attention_models",
    config.attention_models,
    f"a subset of {list(ATTENTION_MODELS)}",
  )
  require(set(config.attention_impls) <= set(IMPLS), "attention_impls", config.attention_impls, f"a subset of {IMPLS}")
  models = SMOKE_ATTENTION_MODELS if config.smoke else {m: ATTENTION_MODELS[m] for m in config.attention_models}
  seq_len = SMOKE_ATTENTION_SEQ_LEN if config.smoke else config.attention_seq_len
  impls = [i for i in IMPLS if i in config.attention_impls]  # IMPLS' order: 'materialized' first
  ceiling, source = read_ceiling(rec.workdir)
  rec.data.update(
    dtype=DTYPE,
    batch=1,
    seq_len=seq_len,
    models=models,
    impls=impls,
    warmup=config.warmup,
    iters=config.iters,
    gemm_tflops=ceiling,
    mfu_reference=source,
    cases=[],
    decode=[],
  )
  ok = True
  for name, shape in models.items():
    reference, want = {}, {}
    for impl in impls:
      ok &= run_case(
        rec,
        "cases",
        {"model": name, "impl": impl, **shape},
        lambda: training_case(impl, shape, seq_len, config, ceiling, reference),
      )
    for impl in ["xla"] + [i for i in impls if i not in ("xla", "materialized", "cudnn_unpadded")]:  # with a cache
      ok &= run_case(
        rec, "decode", {"model": name, "impl": impl, **shape}, lambda: decode_case(impl, shape, seq_len, config, want)
      )
  rec["failed_cases"] = sum("error" in c for kind in ("cases", "decode") for c in rec[kind])
  return ok
