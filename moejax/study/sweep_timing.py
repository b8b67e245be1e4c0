"""The scaling sweep's measured rows (`moejax.study.sweep`): a point timed on the job's devices
(`hosts.mesh_devices`: one host's, or whole hosts of a multi-process job), a layer forward and a real training step
(`time_training_step`, also the GPU suite's train_step timer)."""

import statistics

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moejax.runtime import mesh as mesh_lib
from moejax.study import arrival_calibration, phase_timing, point_models
from moejax.study.inputs import layer_params, random_tokens
from moejax.study.points import Point, identity, moe_section, scheme_config
from moejax.study.price import batch
from moejax.study.repeats import Repeats, timed
from moejax.train import objective
from moejax.train import trainer as train_lib

# Rounds of a mesh's microbenchmarks before its first point, and before each later one (`_retimed`): the terms are
# medians over every round so far, so later points add fewer.
CALIBRATION_ROUNDS = (9, 5)


def time_training_step(
  model_config,
  moe_config,
  mesh,
  batch_shape: tuple[int, int, int],
  seed: int,
  warmup: int,
  repeats: Repeats | int,
  optim: dict = point_models.TIMING_OPTIM,
  terms=None,
) -> dict:
  """Wall-clock of the jitted training step (`moejax.train.trainer.Trainer.step`, state donated, the optimizer of
  `optim`: LAMB by default) of `model_config` (a ModelConfig or DecoderConfig) on one batch of random tokens
  [U, B, S] (U micro batches of B sequences of S tokens): a compiling call, `warmup` untimed calls, then `repeats`
  timed ones (`moejax.study.repeats.timed`: an int, or at least Repeats.least until the median is stable). Seeds: the trainer's `seed`, the tokens' seed + 2.

  Returns {'times_s': [repeats] seconds, 'losses': every call's loss in order (compiling, warm-up, timed),
  'parameters': the model's parameter count}, with `terms` (`moejax.study.program_calibration`) also 'priced_s':
  the timed program's price (`phase_timing.priced_seconds`).
  """
  vocab = model_config.vocab_size
  most = repeats if isinstance(repeats, int) else repeats.most
  train_config = ml_collections.ConfigDict(
    {"seed": seed, "steps": 1 + warmup + most, "optim": optim, "data": {"mask_prob": objective.MASK_PROB}}
  )
  ids = objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=vocab - 2, num_ids=vocab)
  trainer = train_lib.Trainer(train_config, model_config, moe_config, mesh, ids)
  state, rest = trainer.init()
  parameters = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state["params"]))
  tokens_UxBxS = jax.device_put(
    jax.random.randint(jax.random.key(seed + 2), batch_shape, 2, vocab), trainer.batch_sharding
  )
  compiled = trainer.step.lower(state, rest, tokens_UxBxS).compile()  # the program timed is the one priced
  losses = []

  def step():
    nonlocal state
    state, metrics = compiled(state, rest, tokens_UxBxS)
    losses.append(metrics["loss"])
    return state

  times = timed(step, warmup, repeats, mesh)
  priced = {} if terms is None else {"priced_s": phase_timing.priced_seconds(compiled, mesh, terms)}
  return {"times_s": times, "losses": [float(v) for v in losses], "parameters": parameters, **priced}


def training_step(point: Point, config, devices: list, terms=None) -> dict:
  """`time_training_step` of the point's model (`point_models.training_model`, its optimizer) with the point's MoE
  layer on the n x m mesh of `devices`: its global batch as accumulation micro batches of random tokens; `terms`:
  its program priced too."""
  model, moe = config.models[point.model], moe_section(config, point.model)
  cfg = scheme_config(point.scheme, point.nodes, point.gpus_per_node, moe, model.d_model, model.d_ff)
  mesh = mesh_lib.make_mesh(point.nodes, point.gpus_per_node, devices=devices)
  global_batch, accumulation = batch(point, config)
  return time_training_step(
    point_models.training_model(model, moe.dtype),
    cfg,
    mesh,
    (accumulation, global_batch // accumulation, model.seq_len),
    config.sim.seed,
    config.measure.warmup,
    Repeats.of(config.measure),
    point_models.optimizer(model),
    terms,
  )


def _timed_layer(cfg, mesh, tokens: int, dtype, config, terms) -> dict:
  """One MoE layer forward over `tokens` random rows, timed with its phases (`phase_timing.measure_phases`)."""
  params = layer_params(cfg, mesh, config.sim.seed, dtype, config.sim.balanced_router)
  x = random_tokens(mesh, tokens, cfg.d_model, config.sim.seed + 1, dtype)
  return phase_timing.measure_phases(
    params, x, cfg, mesh, config.measure.warmup, Repeats.of(config.measure, "layer_max_repeats"), terms
  )


def _retimed(calibrations: dict, mesh, point: Point):
  """The terms of the point's mesh (`arrival_calibration.MeshCalibration`, kept in `calibrations` by (n, m)),
  re-timed: CALIBRATION_ROUNDS more rounds (the first on the mesh, or a later one), the terms from every round on the
  mesh so far. The first time the terms are logged in full, later a line of the main ones."""
  key = (point.nodes, point.gpus_per_node)
  first = key not in calibrations
  if first:
    calibrations[key] = arrival_calibration.MeshCalibration(mesh)
  calibration = calibrations[key]
  say = (lambda line: logging.info("%s %s", point.mesh, line)) if first else (lambda line: None)
  terms = calibration.retime(CALIBRATION_ROUNDS[0] if first else CALIBRATION_ROUNDS[1], say)
  if not first:
    logging.info(
      "%s terms re-timed over %d rounds: matmul %.2f GFLOP/s, call %.0f us, launch %.1f us",
      point.mesh,
      calibration.rounds,
      terms.flops_per_s / 1e9,
      terms.call_s * 1e6,
      terms.launch_s * 1e6,
    )
  return terms


def measure(point: Point, config, layers: dict, devices: list, terms: dict) -> dict:
  """Wall-clock on `devices` (`hosts.mesh_devices`: the n x m mesh, row i on host i), at the model's shapes: one
  MoE layer forward at the micro batch with its phases (`phase_timing.measure_phases`: inter- and intra-node
  exchanges, expert FFN, the rest), and the whole training step (`moejax.train.trainer.Trainer`: the point's
  global batch as accumulation micro batches of random tokens, forward, backward, the family's optimizer,
  `point_models`). Each: a compiling call and measure.warmup untimed calls, then the median of measure.repeats or more
  (`moejax.study.repeats`: until the median is stable). Every process holding one of `devices` calls it with the same
  arguments (its programs span them all); each gets the same row, its own clock's times. `layers` keeps the layer's timings by (scheme, mesh, model)
  for the other scaling's point. With measure.price_program, both programs are also priced with terms timed on the
  point's mesh, re-timed right before it (`_retimed`): 'priced_layer_ms', 'priced_step_s' and their errors, priced /
  measured - 1. No measured point enters the terms: each is held out."""
  model, moe = config.models[point.model], moe_section(config, point.model)
  n, m = point.nodes, point.gpus_per_node
  cfg = scheme_config(point.scheme, n, m, moe, model.d_model, model.d_ff)
  mesh = mesh_lib.make_mesh(n, m, devices=devices)
  tokens = model.micro_batch * model.seq_len
  mesh_terms = _retimed(terms, mesh, point) if config.measure.price_program else None
  key = (point.scheme, point.mesh, point.model)
  if key not in layers:
    layers[key] = _timed_layer(cfg, mesh, point.devices * tokens, jnp.dtype(moe.dtype), config, mesh_terms)
  global_batch, accumulation = batch(point, config)
  timed = training_step(point, config, devices, mesh_terms)
  step_times, losses = timed["times_s"], timed["losses"]
  step_s = statistics.median(step_times)
  priced = {}
  if mesh_terms is not None:
    layer = layers[key]
    priced = {
      "priced_layer_error": layer["priced_layer_ms"] / layer["layer_ms"] - 1,
      "priced_step_s": timed["priced_s"],
      "priced_step_error": timed["priced_s"] / step_s - 1,
    }
  return {
    **identity(point),
    "routing": cfg.routing,
    "path": cfg.path,
    "collective": cfg.collective,
    "choices_per_token": cfg.choices_per_token,
    "capacity_factor": cfg.capacity_factor,
    "tokens_per_gpu": tokens,
    "global_batch": global_batch,
    "accumulation": accumulation,
    **layers[key],
    "step_s": step_s,
    "step_s_min": min(step_times),
    "samples_per_s": global_batch / step_s,
    "loss_first": losses[0],
    "loss_last": losses[-1],
    "repeats": len(step_times),
    "hosts": len({d.process_index for d in devices}),
    "device": devices[0].device_kind,
    "jax_version": jax.__version__,
    **priced,
  }
