"""Training metrics: one JSON line per step, TensorBoard event files, console reports, a summary.

Per step: loss (task + auxiliary), task_loss (MLM or next-token cross-entropy), accuracy,
aux_loss (summed over MoE layers), grad_norm, learning_rate, step_time_s, tokens_per_s, and per MoE
layer the expert load (fraction of token-choices each expert processed) and the drop rate; with
replication (moe.slots_per_device) per MoE layer the busiest device's load over the mean device load
with the slot tables the step ran on (busiest_load) and with every device running only its own E / D
experts (busiest_load_unreplicated), from the step's expert counts (devices: the nodes with expert
sharding). Every step with MoE layers also records the busiest expert's load over the mean expert load
(max / mean of the step's expert counts) per layer, averaged over the layers (busiest_expert_load), and
with auxiliary-loss-free balancing (moe.bias_update_rate) each layer's bias range max - min after the
step's update (expert_bias_range), so a run shows the balancing acting. On the steps with held-out evaluation
(log.eval_every, `moejax.train.heldout`): heldout_loss, and heldout_unigram_entropy, the entropy of the held-out
tokens' own unigram distribution (the loss of a model that ignores context: the baseline to beat). The writer adds
steps_per_s (this process' steps so far over their wall time, checkpoints and evaluations included) and eta_s (the
steps left at that rate). Every step records skipped (1 where its update was not applied, `moejax.train.guard`, with
its skip_reason) and skipped_steps (the run's count so far, added by the loop); a skipped step's console line says so.
"""

import json
import math
import os
import time

import numpy as np
from absl import logging

from moejax.durations import duration
from moejax.train import guard
from moejax.train import replan as replan_lib
from moejax.validation import is_int, require

SCALARS = ("loss", "task_loss", "accuracy", "aux_loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s")
CONFIG_FIELDS = ("every_steps", "tensorboard", "eval_every", "eval_batches")
BUSIEST = ("busiest_load", "busiest_load_unreplicated")  # with replication: per MoE layer


def validate_config(log, prefix: str = "") -> None:
  """Checks the log section `log` (fields CONFIG_FIELDS); errors name the field with `prefix`
  (e.g. 'log.')."""
  require(is_int(log.every_steps), prefix + "every_steps", log.every_steps, "a positive int")
  require(isinstance(log.tensorboard, bool), prefix + "tensorboard", log.tensorboard, "True or False")
  require(is_int(log.eval_every, 0), prefix + "eval_every", log.eval_every, "an int >= 0 (0: no held-out evaluation)")
  require(is_int(log.eval_batches), prefix + "eval_batches", log.eval_batches, "a positive int")


def step_record(step: int, metrics: dict, step_time_s: float, tokens: int, slot_tables=None) -> dict:
  """A JSON-ready record from the train step's metrics (host arrays) and the host's timing;
  slot_tables: the [M, A, Z] slot tables the step ran on, with replication."""
  counts_MxE = np.asarray(metrics["expert_counts"], np.float64)
  dropped_M = np.asarray(metrics["tokens_dropped"], np.float64)
  overflowed_M = np.asarray(metrics["tokens_overflowed"], np.float64)
  total_M = counts_MxE.sum(axis=1) + dropped_M + overflowed_M  # every token-choice of each MoE layer
  record = {
    "step": step,
    **{k: float(metrics[k]) for k in SCALARS[:6]},
    "step_time_s": step_time_s,
    "tokens_per_s": tokens / step_time_s if step_time_s > 0 else 0.0,
  }
  record["expert_load"] = (counts_MxE / np.maximum(total_M, 1)[:, None]).round(5).tolist()
  record["drop_rate"] = (dropped_M / np.maximum(total_M, 1)).round(6).tolist()  # by capacity
  record["overflow_rate"] = (overflowed_M / np.maximum(total_M, 1)).round(6).tolist()  # by full receive buffers
  if counts_MxE.size:
    record["busiest_expert_load"] = round(busiest_expert_load(counts_MxE), 6)
  if "skipped" in metrics:  # nothing of the step applied (moejax.train.guard)
    record["skipped"] = int(metrics["skipped"])
    if record["skipped"]:
      record["skip_reason"] = "nonfinite" if metrics["nonfinite"] else "loss_spike"
  if "mtp_loss" in metrics:  # DeepSeek-V3's multi-token prediction modules' mean loss (without lambda)
    record["mtp_loss"] = float(metrics["mtp_loss"])
  if "heldout_loss" in metrics and np.isfinite(metrics["heldout_loss"]):  # NaN: not evaluated at this step
    record["heldout_loss"] = float(metrics["heldout_loss"])
  if "expert_bias_range" in metrics:
    record["expert_bias_range"] = [float(x) for x in np.asarray(metrics["expert_bias_range"], np.float64)]
  if slot_tables is not None and counts_MxE.size:
    with_tables, without = replan_lib.busiest_loads(counts_MxE, slot_tables)
    record["busiest_load"] = [round(x, 6) for x in with_tables]
    record["busiest_load_unreplicated"] = [round(x, 6) for x in without]
  return record


def busiest_expert_load(counts_MxE) -> float:
  """The busiest expert's load over the mean expert load (max / mean of counts [M, E]) per MoE layer,
  averaged over the layers with any load (1.0: perfectly balanced; E: one expert takes everything)."""
  counts = np.asarray(counts_MxE, np.float64)
  mean_M = counts.mean(axis=1)
  ratios = counts.max(axis=1)[mean_M > 0] / mean_M[mean_M > 0]
  return float(ratios.mean()) if ratios.size else 0.0


def read_jsonl(path: str, dropped: list | None = None) -> list[dict]:
  """The complete records of a JSONL file (a torn last line, as a kill leaves it, is ignored; appended to `dropped`
  when given)."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except ValueError:
        if dropped is not None:
          dropped.append(line)
  return records


class MetricWriter:
  """Writes records to `workdir/metrics.jsonl` and TensorBoard events under `workdir/tensorboard`.

  start_step: the step training resumes after; records of later steps (logged by a run killed after
  its last checkpoint, and about to be recomputed) are dropped so each step appears once.
  total_steps: the run's last step; each record gets steps_per_s and eta_s. heldout_unigram_entropy: the held-out
  tokens' unigram entropy, added to the records with a heldout_loss.
  Does nothing when not `enabled` (processes other than the first).
  """

  def __init__(
    self,
    workdir: str,
    start_step: int,
    *,
    tensorboard: bool = True,
    enabled: bool = True,
    total_steps: int | None = None,
    heldout_unigram_entropy: float | None = None,
  ):
    self.enabled, self.total_steps, self.baseline = enabled, total_steps, heldout_unigram_entropy
    self.first = None  # (the first step written, when it started)
    if not enabled:
      return
    self.path = os.path.join(workdir, "metrics.jsonl")
    dropped = []
    kept = [r for r in read_jsonl(self.path, dropped) if r.get("step", math.inf) <= start_step]
    if dropped:  # a record cut by a kill (a step after the checkpoint resumed from: it is recomputed)
      logging.warning(
        "%s: dropping %d unreadable line(s), %d characters", self.path, len(dropped), sum(map(len, dropped))
      )
    with open(self.path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(self.path + ".tmp", self.path)
    self.file = open(self.path, "a")
    self.tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, record: dict) -> None:
    """Writes `record`, adding steps_per_s and eta_s (with total_steps) and heldout_unigram_entropy to it first."""
    if not self.enabled:
      return
    if self.total_steps is not None:
      now = time.perf_counter()
      if self.first is None:
        self.first = record["step"], now - record["step_time_s"]
      record["steps_per_s"] = (record["step"] - self.first[0] + 1) / max(now - self.first[1], 1e-9)
      record["eta_s"] = (self.total_steps - record["step"]) / record["steps_per_s"]
    if "heldout_loss" in record and self.baseline is not None:
      record["heldout_unigram_entropy"] = self.baseline
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    if self.tb is not None:
      step = record["step"]
      for name in SCALARS:
        self.tb.add_scalar(f"train/{name}", record[name], step)
      for i, (load, drop) in enumerate(zip(record["expert_load"], record["drop_rate"])):
        self.tb.add_scalar(f"moe/layer{i}/max_load_over_mean", max(load) * len(load), step)
        self.tb.add_scalar(f"moe/layer{i}/drop_rate", drop, step)
        self.tb.add_histogram(f"moe/layer{i}/expert_load", np.asarray(load), step)
      if "heldout_loss" in record:
        self.tb.add_scalar("eval/heldout_loss", record["heldout_loss"], step)
      if "skipped_steps" in record:
        self.tb.add_scalar("train/skipped_steps", record["skipped_steps"], step)
      if "busiest_expert_load" in record:
        self.tb.add_scalar("moe/busiest_expert_load", record["busiest_expert_load"], step)
      for i, value in enumerate(record.get("expert_bias_range", [])):
        self.tb.add_scalar(f"moe/layer{i}/expert_bias_range", value, step)
      for name in BUSIEST:
        for i, value in enumerate(record.get(name, [])):
          self.tb.add_scalar(f"moe/layer{i}/{name}", value, step)

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      if self.tb is not None:
        self.tb.close()


def report_line(record: dict, total_steps: int) -> str:
  """One console line for a record: losses, accuracy, the drop and overflow shares (mean over MoE layers), and
  where they apply the busiest expert's load over the mean (`busiest 2.31x`, averaged over MoE layers, as
  `busiest_expert_load`), the largest bias range over the MoE layers (`bias range 0.0120`, with
  auxiliary-loss-free balancing), the MTP modules' loss (`mtp 5.4321`) and the held-out loss with its unigram
  baseline (`held-out 4.7012 (unigram 4.5900)`); then gradient norm, learning rate, throughput, and where the
  writer added them steps/s and the ETA. A skipped step's line says so after the step, with the run's count
  (`skipped: non-finite loss or gradient norm, 2 so far`)."""
  mean_percent = lambda rates: 100 * float(np.mean(rates)) if rates else 0.0
  drop, overflow = mean_percent(record["drop_rate"]), mean_percent(record.get("overflow_rate", []))
  balance = f"busiest {record['busiest_expert_load']:.2f}x  " if "busiest_expert_load" in record else ""
  if record.get("expert_bias_range"):
    balance += f"bias range {max(record['expert_bias_range']):.4f}  "
  if "mtp_loss" in record:
    balance += f"mtp {record['mtp_loss']:.4f}  "
  if "heldout_loss" in record:
    unigram = record.get("heldout_unigram_entropy")
    balance += f"held-out {record['heldout_loss']:.4f}" + (f" (unigram {unigram:.4f})  " if unigram else "  ")
  progress = f"  {record['steps_per_s']:.2f} steps/s  ETA {duration(record['eta_s'])}" if "eta_s" in record else ""
  skipped = ""
  if record.get("skipped"):
    skipped = f"skipped: {guard.REASONS[record['skip_reason']]}, {record.get('skipped_steps', 1)} so far  "
  return (
    f"step {record['step']}/{total_steps}  {skipped}loss {record['loss']:.4f}  task {record['task_loss']:.4f}  "
    f"acc {record['accuracy']:.3f}  aux {record['aux_loss']:.4f}  drop {drop:.2f}%  "
    f"overflow {overflow:.2f}%  {balance}"
    f"|g| {record['grad_norm']:.3f}  lr {record['learning_rate']:.2e}  "
    f"{record['tokens_per_s']:,.0f} tok/s  {1e3 * record['step_time_s']:.1f} ms/step{progress}"
  )


def summarize(records: list[dict], **extra) -> dict:
  """Summary of a run's records (first, last and best losses of the steps applied; the last held-out loss; median
  throughput; the steps skipped) plus `extra`."""
  skipped = sum(r.get("skipped", 0) for r in records)
  records = [r for r in records if not r.get("skipped")]  # a skipped step's loss (NaN, a spike) changed nothing
  window = records[-10:]
  heldout = [r for r in records if "heldout_loss" in r]
  times = [r["step_time_s"] for r in records[1:]] or [r["step_time_s"] for r in records]
  return {
    "steps": len(records) + skipped,
    "skipped_steps": skipped,
    "first_task_loss": records[0]["task_loss"] if records else None,
    "final_task_loss": float(np.mean([r["task_loss"] for r in window])) if window else None,
    "final_accuracy": float(np.mean([r["accuracy"] for r in window])) if window else None,
    "best_task_loss": min((r["task_loss"] for r in records), default=None),
    "final_heldout_loss": heldout[-1]["heldout_loss"] if heldout else None,
    "median_step_time_s": float(np.median(times)) if times else None,
    "median_tokens_per_s": float(np.median([r["tokens_per_s"] for r in records[1:] or records])) if records else None,
    **{
      f"mean_{name}": float(np.mean([r[name] for r in records]))
      for name in (*BUSIEST, "busiest_expert_load")
      if records and all(name in r for r in records)
    },
    **extra,
  }


def format_summary(summary: dict) -> str:
  """The summary as aligned `name: value` lines for the console."""
  show = lambda v: (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}") if isinstance(v, float) else str(v)
  return "summary\n" + "\n".join(f"  {k:<20} {show(v)}" for k, v in summary.items())


def baseline_line(summary: dict) -> str:
  """The final losses against the data's unigram entropy (summary's unigram_entropy: the tokens trained on), the
  loss of a model that ignores context."""
  heldout = summary.get("final_heldout_loss")
  return (
    f"final task loss {summary['final_task_loss']:.4f}"
    + (f", held-out {heldout:.4f}" if heldout else "")
    + f"; the data's unigram entropy {summary['unigram_entropy']:.4f} nats is the baseline a model must beat "
    "(the loss of predicting every token by its frequency alone)"
  )


def unigram_entropy(counts: np.ndarray) -> float:
  """Entropy in nats of the token distribution `counts`: the loss of the best predictor that
  ignores context, the baseline a language model must beat."""
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())
