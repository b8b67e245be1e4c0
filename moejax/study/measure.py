"""Measured rows: a sweep point timed on this machine's devices, a layer forward and a real training step
(`time_training_step`, also the GPU suite's train_step timer)."""

import statistics

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moejax.kernels.tuning import time_call
from moejax.models.config import ModelConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.study import phase_timing
from moejax.study.inputs import layer_params, random_tokens
from moejax.study.points import Point, identity, scheme_config
from moejax.study.price import batch
from moejax.train import objective
from moejax.train import trainer as train_lib


def fits_real_devices(n: int, m: int, platform: str) -> bool:
  """Whether an n x m mesh can be built from this single process's devices of `platform`: on
  'gpu', one node (n = 1; multi-host points are modelled only); on 'cpu', any shape of the local,
  possibly simulated, devices (to exercise the measured path; CPU times say nothing about GPUs)."""
  if jax.process_count() != 1:
    return False
  try:
    count = len(jax.devices(platform))
  except RuntimeError:  # no such backend
    return False
  return n * m <= count and (platform_lib.simulates_nodes(platform) or n == 1)


# LAMB as in SMILE (Sec. 4.1); the step's cost does not depend on these values.
TIMING_OPTIM = {"learning_rate": 1e-3, "warmup_steps": 0, "decay": "linear", "decay_steps": 0, "end_fraction": 0.0,
                 "b1": 0.9, "b2": 0.999, "eps": 1e-6, "weight_decay": 0.01, "clip_norm": 1.0}


def training_model(model, dtype: str) -> ModelConfig:
  """The BERT-like model (`moejax.models`) of a sweep model: every (layers / moe_layers)-th FFN is an
  MoE layer, heads of width 64 (one head if d_model is not a multiple of 64), dropout 0.1 as in SMILE."""
  heads = model.d_model // 64 if model.d_model % 64 == 0 else 1
  return ModelConfig(kind="bert", vocab_size=model.vocab, num_layers=model.layers, d_model=model.d_model,
                     num_heads=heads, d_ff=model.d_ff, max_len=model.seq_len,
                     dropout=0.1, moe_every=model.layers // model.moe_layers, dtype=dtype)


def time_training_step(model_config: ModelConfig, moe_config, mesh, batch_shape: tuple[int, int, int], seed: int,
                       warmup: int, repeats: int) -> dict:
  """Wall-clock of the jitted training step (`moejax.train.trainer.Trainer.step`, state donated, LAMB with
  `TIMING_OPTIM`) on one batch of random tokens [U, B, S] (U micro batches of B sequences of S tokens): a
  compiling call, `warmup` untimed calls, then `repeats` timed ones (`time_call`). Seeds: the trainer's `seed`,
  the tokens' seed + 2.

  Returns {'times_s': [repeats] seconds, 'losses': every call's loss in order (compiling, warm-up, timed),
  'parameters': the model's parameter count}.
  """
  vocab = model_config.vocab_size
  train_config = ml_collections.ConfigDict({"seed": seed, "steps": 1 + warmup + repeats, "optim": TIMING_OPTIM,
                                            "data": {"mask_prob": objective.MASK_PROB}})
  ids = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=vocab - 2, num_ids=vocab)
  trainer = train_lib.Trainer(train_config, model_config, moe_config, mesh, ids)
  state, rest = trainer.init()
  parameters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["params"]))
  tokens_UxBxS = jax.device_put(jax.random.randint(jax.random.key(seed + 2), batch_shape, 2, vocab),
                                trainer.batch_sharding)
  losses = []

  def step():
    nonlocal state
    state, metrics = trainer.step(state, rest, tokens_UxBxS)
    losses.append(metrics["loss"])
    return state

  times = time_call(step, (), warmup, repeats)
  return {"times_s": times, "losses": [float(v) for v in losses], "parameters": parameters}


def measure(point: Point, config, layers: dict) -> dict:
  """Wall-clock on this machine's devices of platform measure.platform, at the model's shapes: one
  MoE layer forward at the micro batch with its phases (`phase_timing.measure_phases`: inter- and
  intra-node exchanges, expert FFN, the rest), and the whole training step (`moejax.train.trainer.Trainer`:
  the point's global batch as accumulation micro batches of random tokens, forward, backward, LAMB
  update). Each: a compiling call and measure.warmup untimed calls, then the median of
  measure.repeats (`time_call`). `layers` keeps the layer's timings by (scheme, mesh, model) for
  the other scaling's point."""
  model, moe, platform = config.models[point.model], config.moe, config.measure.platform
  n, m = point.nodes, point.gpus_per_node
  cfg = scheme_config(point.scheme, n, m, moe, model.d_model, model.d_ff)
  mesh = mesh_lib.make_mesh(n, m, devices=jax.devices(platform)[:n * m])
  tokens = model.micro_batch * model.seq_len
  dtype = jnp.dtype(moe.dtype)
  key = (point.scheme, point.mesh, point.model)
  if key not in layers:
    params = layer_params(cfg, mesh, config.sim.seed, dtype, config.sim.balanced_router)
    x = random_tokens(mesh, point.devices * tokens, cfg.d_model, config.sim.seed + 1, dtype)
    layers[key] = phase_timing.measure_phases(params, x, cfg, mesh, config.measure.warmup, config.measure.repeats)
    del params, x

  global_batch, accumulation = batch(point, config)
  timed = time_training_step(training_model(model, moe.dtype), cfg, mesh,
                             (accumulation, global_batch // accumulation, model.seq_len), config.sim.seed,
                             config.measure.warmup, config.measure.repeats)
  step_times, losses = timed["times_s"], timed["losses"]
  step_s = statistics.median(step_times)
  return {**identity(point), "routing": cfg.routing, "path": cfg.path, "collective": cfg.collective,
          "choices_per_token": cfg.choices_per_token, "capacity_factor": cfg.capacity_factor,
          "tokens_per_gpu": tokens, "global_batch": global_batch, "accumulation": accumulation,
          **layers[key], "step_s": step_s, "step_s_min": min(step_times), "samples_per_s": global_batch / step_s,
          "loss_first": losses[0], "loss_last": losses[-1], "repeats": config.measure.repeats,
          "device": jax.devices(platform)[0].device_kind, "jax_version": jax.__version__}
