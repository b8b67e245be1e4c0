"""The memory planner's compiles (`experiments/memory.py`): a training config's train step compiled from abstract
arrays on simulated CPU devices of its mesh (nothing allocated), its memory analysis, and the buffers live at the
peak of its schedule."""

import glob
import os
import re
import tempfile
import time

import numpy as np

from moejax.models.decoder_config import DecoderConfig
from moejax.study import memory as memory_lib
from moejax.study.memory import GB

# XLA:CPU's default schedule maximises concurrency and ignores memory; its memory-minimising one is the honest
# stand-in for a GPU compiler that schedules under a memory limit. Optimisation level 0 only speeds compiling.
SCHEDULE = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED", "xla_backend_optimization_level": 0}


def token_ids(vocab: int):
  """Special ids for a vocabulary of `vocab` (the step only reads the padding and mask ids)."""
  from moejax.train import objective

  return objective.TokenIds(pad_id=0, mask_id=1, first_ordinary=2, num_ordinary=vocab - 2, num_ids=vocab)


def compile_step(config, mesh, dump_dir=None):
  """The train step of `config` compiled for `mesh` from abstract arguments -> (memory numbers, seconds, schedule)."""
  import jax

  from moejax.models import state as state_lib
  from moejax.train import config as config_lib
  from moejax.train import trainer as train

  config, model_cfg, moe_cfg = config_lib.checked(config)
  trainer = train.Trainer(config, model_cfg, moe_cfg, mesh, token_ids(model_cfg.vocab_size), donate=True)
  _, _, rest = state_lib.abstract_state(model_cfg, moe_cfg, mesh, config.seed)
  rows = config.batch_size // config.micro_batches
  batch = jax.ShapeDtypeStruct(
    (config.micro_batches, rows, config.seq_len), jax.numpy.int32, sharding=trainer.batch_sharding
  )
  start = time.perf_counter()
  lowered = trainer.step.lower(trainer.abstract_state, rest, batch)
  options = dict(SCHEDULE, **({"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": ".*_step.*"} if dump_dir else {}))
  try:
    compiled, schedule = lowered.compile(compiler_options=options), "memory-optimised"
  except Exception:  # noqa: BLE001  an XLA without the scheduler option: its default schedule
    compiled, schedule = lowered.compile(), "default"
  m = compiled.memory_analysis()
  sizes = {k: float(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
  return sizes, time.perf_counter() - start, schedule


def checked_on(config, mesh):
  """(the config as compiled on `mesh`'s CPU devices, the configured collective, `config_lib.checked` of it): a
  collective XLA:CPU lacks ('ragged') compiled as 'padded', which has the same buffer bounds."""
  from moejax.moe import collective as collective_lib
  from moejax.moe.config import TRANSPORT_ALIASES
  from moejax.runtime import platform as platform_lib
  from moejax.train import config as config_lib

  config = config.copy_and_resolve_references()
  transport = config.moe.get("transport")  # the old name of path and collective, read first where set
  path, configured = TRANSPORT_ALIASES[transport] if transport else (config.moe.path, config.moe.collective)
  if not collective_lib.runs_on(configured, platform_lib.of_mesh(mesh)):
    config.moe.update(path=path, collective="padded", **({"transport": None} if transport else {}))
  return config, configured, config_lib.checked(config)


def peak_buffers(dump_dir: str, top: int = 8) -> list | None:
  """The largest buffers live at the peak of the dumped step's schedule, by shape: [(count, shape, GB)]."""
  names = glob.glob(os.path.join(dump_dir, "*_step*buffer-assignment.txt"))
  ranges = glob.glob(os.path.join(dump_dir, "*_step*live-range.txt"))
  if not names or not ranges:
    return None
  sizes = {
    m[0]: (int(m[1]), m[2])
    for m in re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", open(names[0]).read())
  }
  live = {
    n: (int(a), int(b))
    for n, a, b in re.findall(
      r"^\s+(\S+?)\{[\d,]*\}:(\d+)-(\d+)$", open(ranges[0]).read().split("BufferLiveRange")[-1], re.M
    )
    if n in sizes and not n.startswith("param")
  }
  if not live:
    return None
  events = sorted(
    [(a, sizes[n][0]) for n, (a, b) in live.items()] + [(b + 1, -sizes[n][0]) for n, (a, b) in live.items()]
  )
  level, best, when = 0, -1, 0
  for t, delta in events:
    level += delta
    if level > best:
      best, when = level, t
  by_shape = {}
  for n, (a, b) in live.items():
    if a <= when <= b:
      count, total = by_shape.get(sizes[n][1], (0, 0))
      by_shape[sizes[n][1]] = (count + 1, total + sizes[n][0])
  rows = sorted(((c, shape, total / GB) for shape, (c, total) in by_shape.items()), key=lambda r: -r[2])
  return [{"count": c, "shape": s, "gb": g} for c, s, g in rows[:top]] + [{"live_at_peak_gb": best / GB}]


def variants(cfg) -> list[tuple[int, int]]:
  """The (dense, MoE) block counts to compile and scale from: (1,1), (2,1), (1,2) with both kinds; (0,1), (0,2) or
  (1,0), (2,0) with one. A SMILE model (`ModelConfig`) repeats moe_every blocks (moe_every - 1 dense, then an MoE
  block), so its variants are one and two such periods. For unrolled layers only: a scanned model compiles whole
  (`experiments/memory.py`), its segments of one or two repeats compiling unlike the loop of many."""
  dense, moe = memory_lib.layer_counts(cfg)
  if not isinstance(cfg, DecoderConfig) and cfg.moe_every > 0:
    p = cfg.moe_every
    return [(p - 1, 1), (2 * p - 2, 2)]
  if dense and moe:
    return [(1, 1), (2, 1), (1, 2)]
  return [(0, 1), (0, 2)] if moe else [(1, 0), (2, 0)]


def variant_model(model: dict, decoder: bool, dense: int, moe: int) -> dict:
  """A model section with `dense` dense and `moe` MoE blocks, the dense ones first (DeepSeek's order); a SMILE
  model's num_layers only (its moe_every places the MoE blocks)."""
  model = dict(model)
  model["num_layers"] = dense + moe
  if decoder:
    model["moe_layers"] = (False,) * dense + (True,) * moe
    if model.get("sliding_layers") is not None:
      model["sliding_layers"] = tuple(model["sliding_layers"])[: dense + moe]
  return model


def scale(points: list[tuple[int, int]], values: list[float], target: tuple[int, int]) -> tuple[float, list]:
  """A value at `target` (dense, MoE) blocks from its values at `points`, by least squares on base + per-dense-block
  + per-MoE-block (minimum norm where the points leave a direction free: a SMILE model's dense and MoE counts move
  together, so only their sum per period is fixed). Returns (prediction, [base, per dense, per MoE])."""
  a = np.array([[1.0, d, m] for d, m in points])
  coef, *_ = np.linalg.lstsq(a, np.array(values, float), rcond=None)
  return float(np.array([1.0, *target]) @ coef), [float(c) for c in coef]


def state_bytes(abstract_state: dict) -> tuple[float, float, float, float]:
  """(parameters, optimizer state, the rest of the state, gradients) per device of a trainer's abstract state; the
  step accumulates gradients in float32 zeros sharded like the parameters (precision.zeros_for_accumulation)."""
  import jax

  state = {k: sum(memory_lib.shard_bytes(x) for x in jax.tree.leaves(abstract_state[k])) for k in abstract_state}
  params, optimizer = state.pop("params"), state.pop("opt_state")
  gradients = sum(
    memory_lib.shard_bytes(jax.ShapeDtypeStruct(x.shape, np.float32, sharding=x.sharding))
    for x in jax.tree.leaves(abstract_state["params"])
  )
  return params, optimizer, sum(state.values()), gradients


def compiled_variants(config, mesh, decoder: bool, points: list, whole: bool, explain: bool) -> list[dict]:
  """The train step compiled at each (dense, MoE) block count of `points` (`whole`: the config itself, points its
  own counts): each one's sizes, seconds and schedule, the first's peak buffers where `explain`."""
  compiled = []
  for i, (dense, moe) in enumerate(points):
    variant = config.copy_and_resolve_references()
    if not whole:
      variant.model.update(variant_model(dict(config.model), decoder, dense, moe))
    with tempfile.TemporaryDirectory() as dump:
      sizes, seconds, schedule = compile_step(variant, mesh, dump if explain and i == 0 else None)
      peak = peak_buffers(dump) if explain and i == 0 else None
    compiled.append(
      dict(
        dense=dense, moe=moe, seconds=seconds, schedule=schedule, **sizes, **({"peak_buffers": peak} if peak else {})
      )
    )
  return compiled
