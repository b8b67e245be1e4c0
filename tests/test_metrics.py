"""Per-step training records: expert load, capacity drops and buffer overflow as shares of all
token-choices of each MoE layer."""

import numpy as np

from moejax.train import metrics


def test_step_record_counts_drops_and_overflow_separately():
  rng = np.random.default_rng(0)
  counts_MxE = rng.integers(0, 50, size=(3, 4))
  dropped_M, overflowed_M = rng.integers(1, 20, size=3), rng.integers(1, 20, size=3)
  step_metrics = {
    "loss": 2.0,
    "task_loss": 1.9,
    "accuracy": 0.5,
    "aux_loss": 0.1,
    "grad_norm": 1.0,
    "learning_rate": 1e-3,
    "expert_counts": counts_MxE,
    "tokens_dropped": dropped_M,
    "tokens_overflowed": overflowed_M,
  }
  record = metrics.step_record(7, step_metrics, step_time_s=0.5, tokens=1000)
  total_M = counts_MxE.sum(axis=1) + dropped_M + overflowed_M
  np.testing.assert_allclose(record["drop_rate"], dropped_M / total_M, atol=1e-6)
  np.testing.assert_allclose(record["overflow_rate"], overflowed_M / total_M, atol=1e-6)
  np.testing.assert_allclose(record["expert_load"], counts_MxE / total_M[:, None], atol=1e-5)
  line = metrics.report_line(record, total_steps=10)
  assert f"overflow {100 * np.mean(overflowed_M / total_M):.2f}%" in line
  assert f"drop {100 * np.mean(dropped_M / total_M):.2f}%" in line


def test_report_line_shows_the_busiest_expert_load_and_bias_range():
  counts_MxE = np.array([[10, 30, 20, 40], [25, 25, 25, 25]])
  step_metrics = {
    "loss": 2.0,
    "task_loss": 1.9,
    "accuracy": 0.5,
    "aux_loss": 0.1,
    "grad_norm": 1.0,
    "learning_rate": 1e-3,
    "expert_counts": counts_MxE,
    "tokens_dropped": np.zeros(2),
    "tokens_overflowed": np.zeros(2),
  }
  line = metrics.report_line(metrics.step_record(3, step_metrics, step_time_s=0.5, tokens=1000), total_steps=10)
  busiest = np.mean([40 / 25, 25 / 25])  # max / mean of each layer's counts, averaged over the layers: 1.30
  assert f"busiest {busiest:.2f}x" in line and "busiest 1.30x" in line
  assert "bias range" not in line  # no auxiliary-loss-free balancing

  biased = metrics.step_record(3, {**step_metrics, "expert_bias_range": np.array([0.0123, 0.0456])}, 0.5, 1000)
  line = metrics.report_line(biased, total_steps=10)
  assert "busiest 1.30x  bias range 0.0456" in line  # the largest range over the MoE layers

  dense = metrics.step_record(
    3,
    {
      **step_metrics,
      "expert_counts": np.zeros((0, 4)),
      "tokens_dropped": np.zeros(0),
      "tokens_overflowed": np.zeros(0),
    },
    0.5,
    1000,
  )
  line = metrics.report_line(dense, total_steps=10)
  assert "busiest" not in line and "bias range" not in line and "drop 0.00%" in line
