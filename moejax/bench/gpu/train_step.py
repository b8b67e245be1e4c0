"""The train_step step: tokens/s of the BERT-MoE training step (`moejax.train.trainer.Trainer`), timed as the
scaling study times it (`moejax.study.sweep_timing.time_training_step`)."""

import jax

from moejax.bench.gpu.layer import compute_dtype
from moejax.bench.gpu.record import Record, say, timing
from moejax.bench.gpu.shapes import SMOKE_TRAIN_SHAPE, TRAIN_SHAPE
from moejax.moe import collective as collective_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib


def _train_run(config, shape: dict, model_cfg, moe_cfg: MoEConfig, mesh) -> dict:
  """Timings of the jitted training step (`moejax.study.sweep_timing.time_training_step`) on one random batch."""
  # Imported here: it needs ml_collections, which the other steps do not (a GPU machine may lack it).
  from moejax.study import sweep_timing  # pylint: disable=import-outside-toplevel

  timed = sweep_timing.time_training_step(
    model_cfg, moe_cfg, mesh, (1, shape["batch"], shape["seq_len"]), 0, config.warmup, config.iters
  )
  run = {"expert_backend": moe_cfg.expert_backend, "parameters": timed["parameters"], **timing(timed["times_s"])}
  run["tokens_per_s"] = shape["batch"] * shape["seq_len"] / run["median_s"]
  run["losses"] = timed["losses"]  # the compiling call's, the warm-up calls', then the timed calls'
  return run


def step_train(config, rec: Record):
  from moejax.models.config import ModelConfig  # pylint: disable=import-outside-toplevel

  shape = SMOKE_TRAIN_SHAPE if config.smoke else TRAIN_SHAPE
  dtype = compute_dtype(config)
  collective = collective_lib.resolve("auto", jax.devices()[0].platform)
  mesh = mesh_lib.make_mesh(1, 1)
  model_cfg = ModelConfig(
    kind="bert",
    vocab_size=shape["vocab_size"],
    num_layers=shape["num_layers"],
    d_model=shape["d_model"],
    num_heads=shape["num_heads"],
    d_ff=shape["d_ff"],
    max_len=shape["seq_len"],
    dropout=0.1,
    moe_every=2,
    dtype=dtype,
  )
  rec.data.update(
    shape=shape,
    model="bert",
    moe_every=2,
    dtype=dtype,
    collective=collective,
    mesh="1x1",
    micro_batches=1,
    tokens_per_step=shape["batch"] * shape["seq_len"],
    warmup=config.warmup,
    iters=config.iters,
  )
  runs = []
  rec["runs"] = runs
  for backend in config.train_backends:
    moe_cfg = MoEConfig(
      num_experts=shape["num_experts"],
      top_k=shape["top_k"],
      d_model=shape["d_model"],
      d_ff=shape["d_ff"],
      collective=collective,
      expert_backend=backend,
      activation="gelu",
      dtype=dtype,
    )
    run = _train_run(config, shape, model_cfg, moe_cfg, mesh)
    runs.append(run)
    rec.save()
    say(
      f"train step {backend}: {run['median_s'] * 1e3:.3f} ms, {run['tokens_per_s']:.4g} tokens/s, "
      f"loss {run['losses'][0]:.4g} -> {run['losses'][-1]:.4g}"
    )
