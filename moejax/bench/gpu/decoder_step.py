"""The decoder_step step: tokens/s and MFU of the training step of a Qwen3-MoE-shaped decoder on one device.

The shape is Qwen3-30B-A3B's (moejax.models.presets.PUBLISHED['qwen3_moe']: d 2048, routed experts of d_ff 768,
top-8, 32 query heads over 4 key/value heads of 128, QK-norm, vocab 151936, untied head) with configs/decoder.py's
published recipe (bf16 parameters and compute, an fp32 master copy, AdamW), one sequence batch of DECODER_TOKENS
per step on a 1x1 mesh. For each expert count of config.decoder_experts (128 as published; fewer leave room for more
layers) it takes as many layers as fit: the largest count whose analytic bytes (moejax.study.memory: parameters,
fp32 gradients, master copy and moments, activations under config.decoder_remat, exchange buffers) stay within
config.decoder_memory_fraction of the device's memory limit. A step that runs out of memory all the same is
recorded and retried one layer shallower.

Model FLOPs per step = 6 x active parameters x tokens + attention: the active parameters are the matrices a token
meets (attention projections, router, its top-k routed experts, the output head; not the embedding lookup, no norms),
attention 2 x 2 x heads x head width per visible (causal) query-key pair forward, x3 with the backward. Recomputed
(remat) FLOPs are not counted: MFU = model FLOPs / step time / this run's ceilings GEMM rate.
"""

import jax
import numpy as np

from kernels.tuning import time_call
from moejax.bench.gpu.layer import compute_dtype, read_ceiling
from moejax.bench.gpu.record import Record, say, timing
from moejax.models import qk_norm
from moejax.runtime import mesh as mesh_lib

DECODER_TOKENS = (2, 4096)  # sequences x tokens per step
SMOKE_TOKENS = (2, 16)
SMOKE_BUDGET = 2.5 * 2**20  # bytes the smoke run fits its tiny decoder into (CPU has no memory limit to read)
SMOKE_EXPERTS = (8,)  # one layer of the tiny Qwen3-MoE (top-4) fits SMOKE_BUDGET, two do not


def decoder_config(layers: int, experts: int, backend: str, remat: str, smoke: bool, dtype: str):
  """configs/decoder.py's Qwen3-MoE (published; smoke: tiny) on one device with `layers` MoE layers of `experts`
  experts, the batch of DECODER_TOKENS (smoke: SMOKE_TOKENS) in one micro-batch."""
  from configs import decoder  # pylint: disable=import-outside-toplevel

  config = decoder.get_config("qwen3_moe" if smoke else "qwen3_moe,published")
  batch, seq_len = SMOKE_TOKENS if smoke else DECODER_TOKENS
  config.update(batch_size=batch, seq_len=seq_len, micro_batches=1, steps=1000)
  config.mesh.update(nodes=1, gpus_per_node=1)
  config.data.update(shards=1)
  config.model.update(
    num_layers=layers,
    moe_layers=(True,) * layers,
    remat=remat,
    dtype=dtype,
    param_dtype=dtype,
    max_len=max(config.model.max_len, seq_len),
  )
  config.moe.update(
    num_experts=experts,
    num_nodes=1,
    path="flat",
    buffer_factor=None,
    expert_backend=backend,
    collective="auto",
    dtype=dtype,
  )
  config.optim.update(master_dtype="float32" if dtype == "bfloat16" else None)
  return config


def analytic_bytes(config) -> dict:
  """Bytes one device needs for `config`'s training step by moejax.study.memory's analytic count."""
  from moejax.study import memory  # pylint: disable=import-outside-toplevel
  from moejax.train import config as config_lib  # pylint: disable=import-outside-toplevel

  model_cfg, moe_cfg = config_lib.validate(config)
  state = memory.analytic_state(model_cfg, moe_cfg, 1, 1, config.optim)
  exchange = memory.exchange_bytes(moe_cfg, mesh_lib.make_mesh(1, 1), config.batch_size * config.seq_len)
  activations = memory.analytic_activations(model_cfg, moe_cfg, config.batch_size, config.seq_len, exchange)
  out = {k: float(state[k]) for k in ("parameters", "gradients", "optimizer")}
  out.update(activations=activations["activations"], exchange_buffers=float(exchange["bytes"]))
  out["total"] = sum(out.values())
  return out


def fit_layers(make_config, budget: float, max_layers: int) -> tuple[int, dict | None]:
  """(the most layers L <= max_layers whose make_config(L) fits `budget` bytes, its analytic_bytes), or (0, None):
  the bytes grow with the layers, so the first that does not fit ends the search."""
  best, best_bytes = 0, None
  for layers in range(1, max_layers + 1):
    counted = analytic_bytes(make_config(layers))
    if counted["total"] > budget:
      break
    best, best_bytes = layers, counted
  return best, best_bytes


def parameter_counts(model_cfg, moe_cfg) -> dict:
  """Parameters of a GQA decoder whose every layer is an MoE layer: 'total' (every tensor), 'active' (the matrices one
  token meets, see the module docstring) and the active ones by part."""
  if model_cfg.latent or moe_cfg.num_shared_experts or model_cfg.num_mtp_layers or moe_cfg.shared_gate:
    raise ValueError("parameter_counts counts a Qwen3-MoE-like decoder: GQA attention, routed experts only, no MTP")
  d, w, layers = model_cfg.d_model, model_cfg.head_dim, model_cfg.num_layers
  attention = d * w * (2 * model_cfg.num_heads + 2 * model_cfg.num_kv_heads)  # q, k, v, o projections
  expert = (3 if moe_cfg.gated else 2) * d * moe_cfg.d_ff
  router = d * moe_cfg.num_experts
  head = d * model_cfg.vocab_size
  qk = qk_norm.of(model_cfg).count(model_cfg) if model_cfg.qk_norm else 0
  norms = 2 * d + qk  # per layer: two RMSNorms, and the q/k norms (a head's width, or the whole projections)
  active = {
    "attention": layers * attention,
    "router": layers * router,
    "experts": layers * moe_cfg.top_k * expert,
    "head": head,
  }
  total = (
    layers * (attention + router + moe_cfg.num_experts * expert + norms)
    + d  # the final norm
    + model_cfg.vocab_size * d
    + (0 if model_cfg.tie_embeddings else head)
  )
  return {"total": total, "active": sum(active.values()), "active_by_part": active}


def model_flops(model_cfg, moe_cfg, batch: int, seq_len: int) -> dict:
  """Model FLOPs of one training step (forward and backward) on `batch` sequences of `seq_len` tokens."""
  counts = parameter_counts(model_cfg, moe_cfg)
  tokens = batch * seq_len
  visible_pairs = seq_len * (seq_len + 1) // 2
  attention = 3 * model_cfg.num_layers * batch * visible_pairs * 2 * 2 * model_cfg.num_heads * model_cfg.head_dim
  matmuls = 6 * counts["active"] * tokens
  return {
    "flops": matmuls + attention,
    "matmul_flops": matmuls,
    "attention_flops": attention,
    "tokens": tokens,
    **counts,
  }


def _out_of_memory(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def run_case(config, warmup: int, iters: int, ceiling: float | None) -> dict:
  """Timings, tokens/s, MFU, losses and peak memory of `config`'s jitted training step on random tokens."""
  from moejax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  from moejax.train import objective  # pylint: disable=import-outside-toplevel
  from moejax.train import trainer as train  # pylint: disable=import-outside-toplevel

  model_cfg, moe_cfg = config_lib.validate(config)
  vocab = model_cfg.vocab_size
  ids = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=vocab - 2, num_ids=vocab)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh_lib.make_mesh(1, 1), ids)
  state, rest = trainer.init()
  tokens = jax.device_put(
    jax.random.randint(jax.random.key(2), (1, config.batch_size, config.seq_len), 2, vocab), trainer.batch_sharding
  )
  losses = []

  def step():
    nonlocal state
    state, metrics = trainer.step(state, rest, tokens)
    losses.append(metrics["loss"])
    return state

  case = {
    **timing(time_call(step, (), warmup, iters)),
    "losses": [float(v) for v in losses],
    "parameters_in_state": int(sum(np.prod(a.shape) for a in jax.tree.leaves(state["params"]))),
  }
  flops = model_flops(model_cfg, moe_cfg, config.batch_size, config.seq_len)
  case.update(flops, tokens_per_s=flops["tokens"] / case["median_s"], tflops=flops["flops"] / case["median_s"] / 1e12)
  case["mfu"] = None if ceiling is None else case["tflops"] / ceiling
  stats = jax.devices()[0].memory_stats() or {}
  case["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  return case


def memory_budget(config) -> tuple[float, str]:
  """(bytes the analytic count may fill, where from): config.decoder_memory_fraction of the device's memory limit
  (XLA's pool: XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU's memory), SMOKE_BUDGET in a smoke run."""
  if config.smoke:
    return float(SMOKE_BUDGET), "smoke"
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    raise ValueError(
      f"decoder_step needs the device memory limit (memory_stats), which {jax.devices()[0]} does not "
      "give: run it on a GPU, or with --config.smoke=True"
    )
  return config.decoder_memory_fraction * limit, f"{config.decoder_memory_fraction} x bytes_limit {limit}"


def step_decoder(config, rec: Record) -> bool:
  ceiling, source = read_ceiling(rec.workdir)
  dtype = compute_dtype(config)
  budget, budget_source = memory_budget(config)
  batch, seq_len = SMOKE_TOKENS if config.smoke else DECODER_TOKENS
  rec.data.update(
    model="qwen3_moe",
    mesh="1x1",
    dtype=dtype,
    batch=batch,
    seq_len=seq_len,
    remat=config.decoder_remat,
    budget_bytes=budget,
    budget=budget_source,
    gemm_tflops=ceiling,
    mfu_reference=source,
    warmup=config.warmup,
    iters=config.iters,
  )
  say(f"MFU reference: {ceiling} TFLOP/s ({source}); memory budget {budget / 1e9:.3g} GB ({budget_source})")
  cases = []
  rec["cases"] = cases
  max_layers = 4 if config.smoke else 48  # Qwen3-30B-A3B's 48 layers at most
  for backend in config.decoder_backends:
    for experts in SMOKE_EXPERTS if config.smoke else config.decoder_experts:
      make = lambda layers: decoder_config(layers, experts, backend, config.decoder_remat, config.smoke, dtype)
      layers, counted = fit_layers(make, budget, max_layers)
      case = {"expert_backend": backend, "experts": experts, "layers_fitted": layers, "analytic_bytes": counted}
      cases.append(case)
      if not layers:
        case["skipped"] = f"not one layer of {experts} experts fits {budget / 1e9:.3g} GB by the analytic count"
        rec.save()
        continue
      for tried in range(layers, 0, -1):
        try:
          case.update(run_case(make(tried), config.warmup, config.iters, ceiling), layers=tried)
          break
        except Exception as e:  # pylint: disable=broad-except  (out of memory: one layer fewer; anything else fails)
          if not _out_of_memory(e):
            raise
          case.setdefault("out_of_memory", []).append({"layers": tried, "error": str(e).splitlines()[0][:300]})
          say(f"{experts} experts, {tried} layers: out of memory; one layer fewer")
      rec.save()
      if "median_s" in case:
        mfu = "n/a" if case["mfu"] is None else f"{case['mfu']:.3f}"
        say(
          f"decoder {backend}, {experts} experts x {case['layers']} layers: {case['median_s'] * 1e3:.2f} ms, "
          f"{case['tokens_per_s']:.4g} tokens/s, {case['tflops']:.4g} TFLOP/s, MFU {mfu}, "
          f"loss {case['losses'][0]:.4g} -> {case['losses'][-1]:.4g}"
        )
  return all("median_s" in c or "skipped" in c for c in cases)
