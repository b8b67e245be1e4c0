"""The training loop: steps, metrics, checkpoints, overflow retries, skipped steps (`moejax.train.guard`: counted,
and the run stopped after too many in a row), and the host state that checkpoints carry across processes (the data
iterators', the re-plan window, the skipped steps' count). `moejax.train.trainer.train` sets it up and calls `run`."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from moejax.data import pipeline as data_lib
from moejax.moe import overflow as overflow_lib
from moejax.runtime import mesh as mesh_lib
from moejax.train import guard as guard_lib
from moejax.train import metrics as metrics_lib
from moejax.train import replan as replan_lib
from moejax.validation import require


def gather_data_state(states: list[dict]) -> list[list[int]]:
  """Every shard's data state, in shard order, on every process."""
  local = np.asarray([[s[k] for k in data_lib.STATE_FIELDS] for s in states], np.int32)
  if jax.process_count() > 1:
    local = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, local.shape[-1])
  return local.tolist()


def global_tokens(sharding, local: np.ndarray, global_shape) -> jax.Array:
  """The step's tokens [micro_batches, rows, seq_len] from this process's rows [micro_batches, rows / P, seq_len]
  (its data shards', block `process_index` of the rows). Where this process's devices address more rows than it
  read (a pipeline whose 'stage' axis runs across processes: the batch is replicated over 'stage', so a process
  holding one stage holds all of its stage's rows), every process's rows are gathered first (in process order, the
  rows of one process reading every shard)."""
  index = sharding.addressable_devices_indices_map(global_shape).values()
  addressed = set().union(*(range(*i[1].indices(global_shape[1])) for i in index))
  if len(addressed) != local.shape[1]:
    local = np.concatenate(list(np.asarray(multihost_utils.process_allgather(local))), axis=1)
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


def local_data_state(saved: list[list[int]], shards: int) -> list[dict]:
  require(len(saved) == shards, "data.shards", shards, f"{len(saved)}, as in the checkpoint")
  per_process = shards // jax.process_count()
  mine = saved[jax.process_index() * per_process : (jax.process_index() + 1) * per_process]
  return [dict(zip(data_lib.STATE_FIELDS, s)) for s in mine]


def _compile(trainer, state, rest, global_shape, say):
  start = time.perf_counter()
  step_fn = trainer.step.lower(
    state, rest, jax.ShapeDtypeStruct(global_shape, jnp.int32, sharding=trainer.batch_sharding)
  ).compile()
  seconds = time.perf_counter() - start
  say(f"compiled the train step in {seconds:.1f} s")
  return step_fn, seconds


def host_state(batches, replanner, skips) -> dict:
  """What a checkpoint keeps beside the arrays (JSON): every shard's data state, the re-plan window and the count of
  skipped steps (with the last step applied)."""
  return {
    "data": gather_data_state(batches.state()),
    "replan_window": replanner.state() if replanner else [],
    "skipped_steps": [skips.total, skips.last_applied],
  }


def restored_host_state(saved, shards: int) -> tuple[list[dict], dict]:
  """(this process' data states, {'replan_window', 'skipped_steps'}) from a checkpoint's host state. (A checkpoint
  written before the window was kept holds the data state alone; one before skipped steps were counted, no count.)"""
  saved = saved if isinstance(saved, dict) else {"data": saved, "replan_window": []}
  return local_data_state(saved["data"], shards), {k: v for k, v in saved.items() if k != "data"}


def start_state(trainer, ckpt, shards: int, say):
  """(the step the run resumes after, state, rest, this process's data states, the rest of the host state): the
  latest checkpoint's (said), else a fresh state (step 0, no data states, an empty host state)."""
  state, rest = trainer.init()
  restored = ckpt.restore_latest(trainer.abstract_state)
  if restored is None:
    return 0, state, rest, None, {}
  start, state, saved = restored
  data_states, resumed = restored_host_state(saved, shards)
  say(f"resuming after step {start}")
  return start, state, rest, data_states, resumed


def make_replanner(trainer, tables, resumed: dict):
  """The re-planner of a run with slot tables and moe.replan_every (its window restored from `resumed`), else None."""
  if tables is None or trainer.moe_cfg.replan_every <= 0:
    return None
  nodes, gpus = mesh_lib.axis_sizes(trainer.mesh)
  holders = trainer.moe_cfg.expert_holders(nodes, gpus)  # the slot tables' rows
  replanner = replan_lib.Replanner(
    trainer.moe_cfg.replan_every, trainer.moe_cfg.replan_window, nodes, holders // nodes, tables.shape[-1]
  )
  replanner.restore(resumed.get("replan_window", []))
  return replanner


class _Steps:
  """What changes over a run's steps: the trainer and its compiled step (both replaced when an overflow retry raises
  the buffer factor), the compile seconds, the time the last step was done, the retries and the skipped steps."""

  def __init__(self, config, trainer, rest, global_shape, writer, say, retry, skips, replanner, start):
    self.config, self.trainer, self.rest, self.global_shape = config, trainer, rest, global_shape
    self.writer, self.say, self.retry, self.skips, self.replanner = writer, say, retry, skips, replanner
    self.start, self.retries, self.saved = start, [], None
    self.step_fn, self.compile_s = None, 0.0
    self.last_done = time.perf_counter()

  def compile(self, state):
    self.step_fn, seconds = _compile(self.trainer, state, self.rest, self.global_shape, self.say)
    self.compile_s += seconds

  def finish(self, step, metrics, tables):
    """Writes the step's record (`tables`: the slot tables it ran on); returns the re-planned tables when a re-plan
    is due after it, else None."""
    config, metrics, now = self.config, jax.device_get(metrics), time.perf_counter()
    record = metrics_lib.step_record(
      step, metrics, now - self.last_done, config.batch_size * config.seq_len, slot_tables=tables
    )
    self.last_done = now
    new_tables = None
    if self.replanner is not None:
      self.replanner.observe(metrics["expert_counts"])
      if self.replanner.due(step):
        new_tables = self.replanner.plan()
        record["replanned_slot_tables"] = new_tables.tolist()
    try:
      self.skips.observe(record, self.saved)  # TrainingStopped after too many skipped in a row, the record written
    finally:
      self.writer.write(record)
      if step % config.log.every_steps == 0 or step in (self.start + 1, config.steps) or record.get("skipped"):
        self.say(metrics_lib.report_line(record, config.steps))
    return new_tables

  def attempt(self, moe_cfg, before, tokens):
    """(state, metrics) of the step from `before` under `moe_cfg` (compiled anew for a new buffer_factor), and the
    token-choices it lost to full receive buffers (counted only with `retry`)."""
    if moe_cfg is not self.trainer.moe_cfg:
      self.trainer = self.trainer.with_moe(moe_cfg)
      self.compile(before)
    state, metrics = self.step_fn(before, self.rest, tokens)
    return (state, metrics), int(np.sum(jax.device_get(metrics["tokens_overflowed"]))) if self.retry else 0

  def on_retry(self, step, overflowed, moe_cfg):
    self.say(
      f"step {step}: {overflowed} token-choices overflowed the receive buffers at buffer_factor "
      f"{self.trainer.moe_cfg.buffer_factor:g}; repeating the step with {moe_cfg.buffer_factor:g}"
    )
    self.retries.append((step, moe_cfg.buffer_factor))

  def run_step(self, step, state, tokens):
    """(state, metrics) of `step`, repeated with a larger buffer factor while its receive buffers overflow."""
    (state, metrics), _ = overflow_lib.until_no_overflow(
      functools.partial(self.attempt, before=state, tokens=tokens),
      self.trainer.moe_cfg,
      functools.partial(self.on_retry, step),
    )
    return state, metrics


def run(
  config, trainer, state, rest, start: int, batches, ckpt, writer, say, retry: bool, resumed: dict | None = None
) -> tuple[float, np.ndarray, list]:
  """Steps start + 1 .. config.steps, logging and checkpointing; returns (compile seconds, counts
  of every token id this process fed, for the unigram baseline, and the overflow retries as
  (step, new buffer_factor) pairs). With `retry`, a step whose receive buffers overflowed is run
  again from the same state with the buffer factor doubled, until nothing overflows (at the
  worst-case size nothing can). With replication, every step's record has the busiest device's load
  with and without the slot tables it ran on, and with moe.replan_every the tables are re-planned
  after every replan_every-th step from its counts (`moejax.train.replan`). resumed: the host state a checkpoint
  kept besides the data's (`restored_host_state`: the window of counts, so resuming re-plans as the uninterrupted run
  does; the count of skipped steps). After train.max_nonfinite_steps skipped steps in a row it raises
  `guard.TrainingStopped` (one line naming the step and the last checkpoint), saving nothing more."""
  counts = np.zeros(trainer.tok.num_ids, np.int64)
  resumed = resumed or {}
  if start >= config.steps:
    return 0.0, counts, []
  skips = guard_lib.SkipCounter(
    guard_lib.settings(config)["max_nonfinite_steps"], *resumed.get("skipped_steps", (0, start))
  )
  global_shape = (config.micro_batches, config.batch_size // config.micro_batches, config.seq_len)
  tables = np.asarray(jax.device_get(state["slot_tables"])) if "slot_tables" in state else None
  replanner = make_replanner(trainer, tables, resumed)
  loop = _Steps(config, trainer, rest, global_shape, writer, say, retry, skips, replanner, start)
  loop.saved = (start, ckpt.directory) if start else None  # the newest checkpoint, for a stop's message
  loop.compile(state)
  loop.last_done = time.perf_counter()
  pending = None
  for step in range(start + 1, config.steps + 1):
    local = next(batches)
    counts += np.bincount(local.reshape(-1), minlength=trainer.tok.num_ids)[: trainer.tok.num_ids]
    state, metrics = loop.run_step(step, state, global_tokens(loop.trainer.batch_sharding, local, global_shape))
    if pending is not None:  # fetch the previous step's metrics while this one runs
      loop.finish(*pending)
    pending = (step, metrics, tables)
    if replanner is not None and replanner.due(step):  # needs this step's counts: wait for them
      tables, pending = loop.finish(*pending), None
      state = {**state, "slot_tables": loop.trainer.put_slot_tables(tables)}  # same shape: no recompilation
    if step % config.checkpoint.every_steps == 0 or step == config.steps:
      if pending is not None:
        loop.finish(*pending)  # first, so that no step's time includes the checkpoint's
      pending = None
      ckpt.save(step, state, host_state(batches, replanner, skips))
      loop.saved = (step, ckpt.directory)
      loop.last_done = time.perf_counter()
  return loop.compile_s, counts, loop.retries
