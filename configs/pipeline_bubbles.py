"""The pipeline schedules' bubbles counted from their timetables, against the published formulas
(experiments/pipeline_bubbles.py).

  python -m experiments.pipeline_bubbles                                              # prints the tables
  python -m experiments.pipeline_bubbles --workdir=benchmarks/results/2026-11-27-cpu  # and pipeline_bubbles.json
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.schedules = ("gpipe", "1f1b", "interleaved", "dualpipe", "dualpipev")
  config.stages = (2, 4, 8)  # p: the stages of each schedule's formula (DualPipeV: p stages on p/2 devices)
  config.micro_batches = (4, 8, 16)
  config.virtual_stages = 2  # v of the interleaved schedule; its chunks take 1/v of a stage's times
  # The second table's per-stage times (the first has F = B = 1, W = 0): the backward's input part as long as the
  # forward (the zero-bubble papers' T_F = T_B = T_W), and a paired F&B as long as F + B (nothing overlapped).
  config.f, config.b, config.w, config.fb = 1.0, 2.0, 1.0, 3.0
  config.picture = (4, 8)  # (p, m) of the timetables drawn
  return config
