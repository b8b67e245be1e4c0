"""The mixers step: Qwen3-Next's gated DeltaNet (`moejax.models.mixers`) at Qwen3-Next-80B-A3B's published shapes
(`moejax.bench.gpu.shapes.MIXER_MODELS`), one sequence of each length of config.mixer_seq_lens: forward and
forward+backward of each implementation, its FLOPs and TFLOP/s, the compiled programs' temporary bytes, and its
largest difference from moejax's recurrent rule (token by token) on a prefix of config.mixer_check_len tokens.

  chunked   `chunked_gated_delta_rule` (a lax.scan over chunks) at each chunk size of config.mixer_chunks
  tokamax   tokamax.ops.kimi_delta_attention(implementation='xla_chunked', chunk 64) as the gated delta rule: Kimi
            delta attention's decay is per key channel, here the same for every channel; its gate activation
            lower_bound * sigmoid(exp(a_log) x) with a_log = 0 is given x = logit(g / lower_bound), so the decay is
            g. Times include the layout changes (heads first, key heads repeated to the value heads). tokamax's own
            gated delta rule op (`causal_conv1d_gated_delta_rule`, tokamax.ops.tpu) is a Pallas Mosaic TPU serving
            kernel over paged states, forward only, whose other implementation is its reference: not timed.
  layer     the whole layer `gated_deltanet_mixer` (projections, convolution, rule at chunk 64, gated norm,
            output projection); its check: the prefix's output against the same layer decoding token by token

Inputs: q, k (L2-normalised), v [1, S, H, K] in bf16 as the projections give them; the decay g [1, S, H] =
LOWER_BOUND * sigmoid(N(-3, 1)) and beta = sigmoid(N(0, 1)) in float32, as the layer computes them; the rule itself
computes in float32. FLOPs count the matmuls of the chunked form (moejax's `_chunk_step`), per chunk of C tokens and
value head, K = key width, V = value width:

  k_beta k^T (the UT transform's A)                      2 C^2 K
  the unit lower solve (I + A) [u | w] = [beta v | ...]  C^2 (V + K)
  w S (what the old state predicts)                      2 C K V
  q k^T                                                  2 C^2 K
  (q e^g) S and attn v_new (the output)                  2 C K V + 2 C^2 V
  k^T v_new (the state update)                           2 C K V

C^2 (5 K + 3 V) + 6 C K V per chunk, so S H (C (5 K + 3 V) + 6 K V) forward (tokamax's at its chunk 64), and the
layer's projections besides, 2 S D (2 Hk K + 2 H V + 2 H) in and 2 S H V D out (elementwise work not counted);
forward+backward counted as 3x the forward (the attention step's convention). The difference: max |got - want| /
max |want| of the output and of each gradient (of q, k, v, g and beta; the layer: its output only).
"""

import importlib.util
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from kernels.tuning import time_call
from moejax.bench.gpu import shapes
from moejax.bench.gpu.attention import Skipped, compiled, temp_bytes
from moejax.bench.gpu.record import Record, say, timing
from moejax.models.mixers import delta_rule, gated_deltanet
from moejax.validation import require

IMPLS = ("chunked", "tokamax", "layer")
LOWER_BOUND = -5.0  # the decay's floor (tokamax's lower_bound): g in (LOWER_BOUND, 0)
TOKAMAX_CHUNK = 64


def rule_flops(cfg: gated_deltanet.GatedDeltaNetConfig, seq_len: int, chunk: int) -> int:
  """Forward matmul FLOPs of the chunked rule over one sequence: S H (C (5 K + 3 V) + 6 K V) (module docstring)."""
  k, v = cfg.head_k_dim, cfg.head_v_dim
  return seq_len * cfg.num_v_heads * (chunk * (5 * k + 3 * v) + 6 * k * v)


def layer_flops(cfg: gated_deltanet.GatedDeltaNetConfig, seq_len: int) -> int:
  """The layer's forward matmul FLOPs: its projections and the rule at its chunk."""
  projections = 2 * seq_len * cfg.hidden_size * (2 * cfg.key_dim + 2 * cfg.value_dim + 2 * cfg.num_v_heads)
  return projections + 2 * seq_len * cfg.value_dim * cfg.hidden_size + rule_flops(cfg, seq_len, cfg.chunk)


def max_rel_diff(got, want) -> float:
  """max |got - want| / max |want| (float32)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def rule_inputs(cfg: gated_deltanet.GatedDeltaNetConfig, seq_len: int, seed: int = 0) -> tuple:
  """q_1xSxHkxK, k_1xSxHkxK (L2-normalised), v_1xSxHxV bf16; g_1xSxH, beta_1xSxH, the output cotangent
  dout_1xSxHxV float32."""
  kq, kk, kv, kg, kb, kd = jax.random.split(jax.random.key(seed), 6)
  hk, h, kd_, vd = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
  q, k = (delta_rule.l2_normalize(jax.random.normal(key, (1, seq_len, hk, kd_))) for key in (kq, kk))
  return (
    q.astype(jnp.bfloat16),
    k.astype(jnp.bfloat16),
    jax.random.normal(kv, (1, seq_len, h, vd), jnp.bfloat16),
    LOWER_BOUND * jax.nn.sigmoid(jax.random.normal(kg, (1, seq_len, h)) - 3.0),
    jax.nn.sigmoid(jax.random.normal(kb, (1, seq_len, h))),
    jax.random.normal(kd, (1, seq_len, h, vd), jnp.float32),
  )


def layer_inputs(cfg: gated_deltanet.GatedDeltaNetConfig, seq_len: int, seed: int = 0) -> tuple:
  """(params in Qwen3-Next's layout, bf16 but A_log and dt_bias (float32, transformers' initialisation);
  x_1xSxD bf16; dy_1xSxD float32)."""
  keys = jax.random.split(jax.random.key(seed), 7)
  d, h = cfg.hidden_size, cfg.num_v_heads

  def weight(key, shape, fan_in):
    return (jax.random.normal(key, shape) * fan_in**-0.5).astype(jnp.bfloat16)

  params = {
    "in_proj_qkvz.weight": weight(keys[0], (2 * cfg.key_dim + 2 * cfg.value_dim, d), d),
    "in_proj_ba.weight": weight(keys[1], (2 * h, d), d),
    "conv1d.weight": weight(keys[2], (cfg.conv_dim, 1, cfg.conv_kernel), cfg.conv_kernel),
    "dt_bias": jnp.ones((h,), jnp.float32),
    "A_log": jnp.log(jax.random.uniform(keys[3], (h,), jnp.float32, 1.0, 16.0)),
    "norm.weight": jnp.ones((cfg.head_v_dim,), jnp.bfloat16),
    "out_proj.weight": weight(keys[4], (d, cfg.value_dim), cfg.value_dim),
  }
  x = jax.random.normal(keys[5], (1, seq_len, d), jnp.bfloat16)
  return params, x, jax.random.normal(keys[6], (1, seq_len, d), jnp.float32)


def tokamax_rule(q, k, v, g, beta):
  """The gated delta rule through tokamax's Kimi delta attention (module docstring): moejax's arguments and output
  ([B, S, H, ...]); Skipped where tokamax or its op is missing."""
  if importlib.util.find_spec("tokamax") is None:
    raise Skipped("tokamax not installed")
  try:
    from tokamax import ops  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    raise Skipped(f"tokamax does not import: {type(e).__name__}: {e}".splitlines()[0]) from e
  if not hasattr(ops, "kimi_delta_attention"):
    raise Skipped("this tokamax has no kimi_delta_attention (its only chunked delta rule off TPUs)")
  heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # [B, S, H, ...] -> [H, B, S, ...]
  rep = v.shape[2] // k.shape[2]
  q, k = (heads_first(jnp.repeat(x, rep, axis=2)) for x in (q, k))
  ratio = g / LOWER_BOUND
  gate = jnp.broadcast_to(heads_first(jnp.log(ratio) - jnp.log1p(-ratio))[..., None], q.shape)
  o, _ = ops.kimi_delta_attention(
    q,
    k,
    heads_first(v),
    gate,
    heads_first(beta),
    a_log=jnp.zeros((v.shape[2],), jnp.float32),
    use_gate_in_kernel=True,
    lower_bound=LOWER_BOUND,
    implementation="xla_chunked",
  )
  return jnp.moveaxis(o, 0, 2)


def rule_fn(impl: str, chunk: int):
  """fn(q, k, v, g, beta) -> o_BxSxHxV of a rule implementation."""
  if impl == "tokamax":
    return tokamax_rule
  if impl == "recurrent":
    return lambda *xs: delta_rule.recurrent_gated_delta_rule(*xs)[0]
  return lambda *xs: delta_rule.chunked_gated_delta_rule(*xs, chunk=chunk)[0]


def programs(impl: str, cfg, chunk: int, seq_len: int, seed: int = 0, aux: bool = False):
  """(arguments, forward, forward+backward) of one implementation at seq_len: the layer's over (params, x), a rule's
  over (q, k, v, g, beta); the forward+backward returns the loss sum(out * cotangent) (with aux: (loss, out)) and
  every argument's gradient."""
  if impl == "layer":
    params, x, dout = layer_inputs(cfg, seq_len, seed)
    args, fn = (params, x), lambda p, x: gated_deltanet.gated_deltanet_mixer(p, x, cfg)[0]
  else:
    *args, dout = rule_inputs(cfg, seq_len, seed)
    args, fn = tuple(args), rule_fn(impl, chunk)

  def loss(*a):
    out = fn(*a)
    value = jnp.sum(out.astype(jnp.float32) * dout)
    return (value, out) if aux else value

  return args, fn, jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=aux)


def layer_decoded(cfg, params, x_BxSxD):
  """The layer over x one token at a time from an empty cache (its recurrent rule): y_BxSxD."""

  def step(cache, x_t):
    y, cache = gated_deltanet.gated_deltanet_mixer(params, x_t[:, None], cfg, cache)
    return cache, y[:, 0]

  cache = gated_deltanet.empty_cache(cfg, x_BxSxD.shape[0], x_BxSxD.dtype)
  return jnp.moveaxis(jax.lax.scan(step, cache, jnp.moveaxis(x_BxSxD, 1, 0))[1], 0, 1)


def check(impl: str, cfg, chunk: int, tokens: int, reference: dict) -> dict:
  """The largest differences of impl from the recurrent rule (the layer: from itself decoding) on `tokens` tokens,
  the inputs' values in float32 (a bf16 output would round the float32 rule's differences away); `reference` caches
  the recurrent rule's output and gradients."""
  args, fn, fwd_bwd = programs(impl, cfg, chunk, tokens, seed=1, aux=True)
  args = jax.tree.map(lambda a: a.astype(jnp.float32), args)
  if impl == "layer":
    want = jax.jit(lambda p, x: layer_decoded(cfg, p, x))(*args)
    return {"out": max_rel_diff(jax.jit(fn)(*args), want)}
  if not reference:
    ref_fwd_bwd = programs("recurrent", cfg, chunk, tokens, seed=1, aux=True)[2]
    (_, reference["out"]), reference["grads"] = jax.jit(ref_fwd_bwd)(*args)
  (_, out), grads = jax.jit(fwd_bwd)(*args)
  diffs = {"out": max_rel_diff(out, reference["out"])}
  diffs.update(
    {f"d{n}": max_rel_diff(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), grads, reference["grads"])}
  )
  return diffs


def measure(impl: str, cfg, chunk: int, seq_len: int, config) -> dict:
  """Timings, FLOPs, TFLOP/s and temporary bytes of impl's forward and forward+backward at seq_len."""
  args, fn, fwd_bwd = programs(impl, cfg, chunk, seq_len)
  flops = layer_flops(cfg, seq_len) if impl == "layer" else rule_flops(cfg, seq_len, chunk)
  case = {"flops_fwd": flops, "flops_fwd_bwd": 3 * flops}
  for passes, program in (("fwd", fn), ("fwd_bwd", fwd_bwd)):
    program = compiled(program, *args)
    case[passes] = timing(time_call(program, args, config.warmup, config.iters))
    case[f"temp_bytes_{passes}"] = temp_bytes(program)
    case[f"tflops_{passes}"] = case[f"flops_{passes}"] / case[passes]["median_s"] / 1e12
  return case


def run_case(rec: Record, case: dict, cfg, seq_len: int, config, checks: dict, reference: dict) -> bool:
  """Measures one case into rec['cases'] (or why it was skipped, or the error); False on error. The prefix check runs
  once per implementation and chunk (`checks`; `reference`: the recurrent rule's results) and is copied into each of
  its cases."""
  impl, chunk = case["impl"], case["chunk"]
  try:
    if (impl, chunk) not in checks:
      checks[(impl, chunk)] = check(impl, cfg, chunk, check_len(config), reference)
    case["max_rel_diff"] = checks[(impl, chunk)]
    case.update(measure(impl, cfg, chunk, seq_len, config))
  except Skipped as e:
    case["skipped"] = str(e)
  except Exception:  # pylint: disable=broad-except  # recorded; the other cases still run
    case["error"] = traceback.format_exc()
  rec["cases"].append(case)
  rec.save()
  timed = " ".join(f"{p} {case[p]['median_s'] * 1e3:.3f} ms" for p in ("fwd", "fwd_bwd") if p in case)
  why = case.get("skipped") or (case.get("error", "").strip().splitlines() or [""])[-1]
  say(f"mixers {case['model']} {impl} C={chunk} S={seq_len}: {timed or why} {case.get('max_rel_diff', '')}")
  return "error" not in case


def check_len(config) -> int:
  """Tokens of the prefix checked against the recurrent rule."""
  return shapes.SMOKE_MIXER_CHECK_LEN if config.smoke else config.mixer_check_len


def step_mixers(config, rec: Record):
  """Every model, length and implementation of the config (smoke: the tiny fixed ones) into rec['cases']; False if
  a case raised."""
  models_known = list(shapes.MIXER_MODELS)
  require(set(config.mixer_models) <= set(models_known), "mixer_models", config.mixer_models, f"of {models_known}")
  require(set(config.mixer_impls) <= set(IMPLS), "mixer_impls", config.mixer_impls, f"a subset of {IMPLS}")
  if config.smoke:
    models, seq_lens, chunks = shapes.SMOKE_MIXER_MODELS, shapes.SMOKE_MIXER_SEQ_LENS, shapes.SMOKE_MIXER_CHUNKS
  else:
    models = {m: shapes.MIXER_MODELS[m] for m in config.mixer_models}
    seq_lens, chunks = tuple(config.mixer_seq_lens), tuple(config.mixer_chunks)
  variants = [(i, c) for i in IMPLS if i in config.mixer_impls for c in (chunks if i == "chunked" else [None])]
  rec.data.update(
    dtype="bfloat16",
    batch=1,
    models=models,
    seq_lens=seq_lens,
    chunks=chunks,
    impls=list(config.mixer_impls),
    check_len=check_len(config),
    lower_bound=LOWER_BOUND,
    warmup=config.warmup,
    iters=config.iters,
    cases=[],
  )
  ok = True
  for name, shape in models.items():
    cfg = gated_deltanet.GatedDeltaNetConfig.from_hf(shape)
    checks, reference = {}, {}
    # the rules, then the layer (its forward+backward hangs on XLA:CPU at the published shape); within each, the
    # shorter sequences of every implementation first
    for group in ([v for v in variants if v[0] != "layer"], [v for v in variants if v[0] == "layer"]):
      for seq_len, (impl, chunk) in ((s, v) for s in seq_lens for v in group):
        chunk = chunk or (TOKAMAX_CHUNK if impl == "tokamax" else cfg.chunk)
        case = {"model": name, "impl": impl, "chunk": chunk, "seq_len": seq_len}
        ok &= run_case(rec, case, cfg, seq_len, config, checks, reference)
  rec["failed_cases"] = sum("error" in c for c in rec["cases"])
  return ok
