"""A finished training run's summary (`summary.json`, and the lines printed): its metrics' summary, the tokens'
unigram entropy (the loss a model without context reaches), the documents read and the lines skipped."""

import json
import os

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from moejax.data import pipeline as pipeline_lib
from moejax.train import loop as loop_lib
from moejax.train import metrics as metrics_lib


def write(workdir: str, tok, counts: np.ndarray, data_states, leader: bool, say, *, heldout_unigram_entropy, **run):
  """The run's summary, written to <workdir>/summary.json and said by the leader. counts: this process's token
  counts [ids] (summed over the processes here); data_states: this process's data states at the end; run: the
  summary's fields of the run (compile_s, run_s, resumed_from, overflow_retries, buffer_factor)."""
  if jax.process_count() > 1:
    counts = np.asarray(multihost_utils.process_allgather(counts.astype(np.float32))).sum(axis=0)
  ordinary = counts[tok.first_ordinary : tok.first_ordinary + tok.num_ordinary]
  data_state = loop_lib.gather_data_state(data_states)
  summary = metrics_lib.summarize(
    metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if leader else [],
    **run,
    unigram_entropy=metrics_lib.unigram_entropy(ordinary) if ordinary.sum() else None,
    log_vocab=float(np.log(tok.num_ids)),
    heldout_unigram_entropy=heldout_unigram_entropy,
    documents=int(sum(s[pipeline_lib.STATE_FIELDS.index("documents")] for s in data_state)),
    malformed_lines=int(sum(s[pipeline_lib.STATE_FIELDS.index("malformed")] for s in data_state)),
  )
  if leader:
    path = os.path.join(workdir, "summary.json")
    with open(path + ".tmp", "w") as f:  # replaced whole: a run killed while writing it leaves the one before
      json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)
    say(metrics_lib.format_summary(summary))
    if summary["final_task_loss"] is not None and summary["unigram_entropy"] is not None:
      say(metrics_lib.baseline_line(summary))
    say(f"curves: python -m experiments.plot_run {workdir}  (writes {workdir}/curves.png)")
  logging.info("training finished: %s", summary)
  return summary
