"""experiments/plot_run.py on metrics.jsonl files written by the real MetricWriter: the panels' titles and lines
against values recomputed from the raw step metrics, panels without data, and one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import plot_run
from moejax.train import metrics
from tests.helpers import ENV

STEPS, LAYERS, EXPERTS = 6, 2, 4


def _write_run(workdir, bias: bool, moe: bool = True, mtp: bool = False) -> list[dict]:
  """Writes STEPS records with the real writer (no TensorBoard) into `workdir`; returns the raw step metrics
  (the inputs of each record) for the checks."""
  rng = np.random.default_rng(1 if bias else 0)
  writer = metrics.MetricWriter(str(workdir), start_step=0, tensorboard=False)
  raw = []
  for step in range(1, STEPS + 1):
    layers, experts = (LAYERS, EXPERTS) if moe else (0, 0)
    step_metrics = {"loss": 5.0 - 0.5 * step, "task_loss": 4.9 - 0.5 * step, "accuracy": 0.1 * step,
                    "aux_loss": 0.01 * step, "grad_norm": 1.0, "learning_rate": 1e-3 * step,
                    "expert_counts": rng.integers(1, 100, size=(layers, experts)),
                    "tokens_dropped": rng.integers(0, 20, size=layers),
                    "tokens_overflowed": rng.integers(0, 20, size=layers)}
    if bias:
      step_metrics["expert_bias_range"] = rng.uniform(0, 0.05, size=layers)
    if mtp:
      step_metrics["mtp_loss"] = 5.5 - 0.4 * step
    raw.append(step_metrics)
    writer.write(metrics.step_record(step, step_metrics, step_time_s=0.25 * step, tokens=1000))
  writer.close()
  return raw


def _axes_by_title(fig) -> dict:
  return {ax.get_title(): ax for ax in fig.axes}


def _lines(ax) -> dict:
  return {line.get_label(): line for line in ax.get_lines()}


@pytest.mark.parametrize("bias", [False, True])
def test_panels_draw_the_records(tmp_path, bias):
  raw = _write_run(tmp_path, bias)
  records = plot_run.load_records(str(tmp_path))
  fig = plot_run.draw(records, "run")
  axes = _axes_by_title(fig)
  titles = [t for t in axes if t]
  assert len(titles) == 6
  for title in titles:  # every panel names its units
    assert "(" in title and ")" in title, title
  assert all(ax.get_xlabel() == "step" for ax in fig.axes[-2:])
  steps = list(range(1, STEPS + 1))

  loss = _lines(axes["loss (cross-entropy, nats)"])
  np.testing.assert_allclose(loss["task"].get_ydata(), [m["task_loss"] for m in raw])
  np.testing.assert_allclose(loss["total (task + aux)"].get_xdata(), steps)
  np.testing.assert_allclose(loss["total (task + aux)"].get_ydata(), [m["loss"] for m in raw])
  aux = _lines(axes["auxiliary loss (summed over MoE layers, unitless)"])
  np.testing.assert_allclose(aux["aux"].get_ydata(), [m["aux_loss"] for m in raw])

  busiest = _lines(axes["busiest expert load (x the mean expert load; 1.0 = balanced)"])
  for layer in range(LAYERS):  # max / mean of the raw counts (the record keeps loads rounded to 5 digits)
    expected = [m["expert_counts"][layer].max() / m["expert_counts"][layer].mean() for m in raw]
    np.testing.assert_allclose(busiest[f"MoE layer {layer}"].get_ydata(), expected, rtol=1e-3)
  assert list(busiest["balanced"].get_ydata()) == [1.0, 1.0]

  lost = _lines(axes["drops and overflow (% of all token-choices, mean over MoE layers)"])
  total = [m["expert_counts"].sum(axis=1) + m["tokens_dropped"] + m["tokens_overflowed"] for m in raw]
  np.testing.assert_allclose(lost["dropped (expert capacity)"].get_ydata(),
                             [100 * np.mean(m["tokens_dropped"] / t) for m, t in zip(raw, total)], atol=1e-3)
  np.testing.assert_allclose(lost["overflowed (receive buffers)"].get_ydata(),
                             [100 * np.mean(m["tokens_overflowed"] / t) for m, t in zip(raw, total)], atol=1e-3)

  throughput = _lines(axes["throughput (tokens/s)"])
  np.testing.assert_allclose(throughput["tokens/s"].get_ydata(), [1000 / (0.25 * s) for s in steps])

  bias_ax = axes["expert bias range (max - min of each layer's bias, score units)"]
  texts = [t.get_text() for t in bias_ax.texts]
  if bias:
    ranges = _lines(bias_ax)
    for layer in range(LAYERS):
      np.testing.assert_allclose(ranges[f"MoE layer {layer}"].get_ydata(),
                                 [m["expert_bias_range"][layer] for m in raw])
    assert not texts and "no data" not in fig.get_suptitle()
  else:
    assert not bias_ax.get_lines()
    assert texts == ["no data: no auxiliary-loss-free balancing (moe.bias_update_rate = 0)"]
    assert fig.get_suptitle().endswith("\nno data: expert bias range")


def test_a_run_with_mtp_modules_draws_their_loss(tmp_path):
  """DeepSeek-V3's multi-token prediction: the loss panel names the total with it and draws the modules' loss."""
  raw = _write_run(tmp_path, bias=False, mtp=True)
  loss = _lines(_axes_by_title(plot_run.draw(plot_run.load_records(str(tmp_path)), "run"))["loss (cross-entropy, nats)"])
  assert set(loss) == {"total (task + aux + lambda x MTP)", "task", "MTP (mean of the modules)"}
  np.testing.assert_allclose(loss["MTP (mean of the modules)"].get_ydata(), [m["mtp_loss"] for m in raw])


def test_a_run_without_moe_layers_says_which_panels_are_empty(tmp_path):
  _write_run(tmp_path, bias=False, moe=False)
  fig = plot_run.draw(plot_run.load_records(str(tmp_path)), "dense")
  empty = [ax.get_title() for ax in fig.axes if any(t.get_text().startswith("no data") for t in ax.texts)]
  assert [t.split(" (")[0] for t in empty] == ["busiest expert load", "drops and overflow",
                                               "expert bias range"]
  assert fig.get_suptitle() == ("dense: 6 steps (1 to 6)\nno data: busiest expert load, drops and overflow, "
                                "expert bias range")


def test_a_run_without_drops_draws_them_at_zero_and_says_so(tmp_path):
  _write_run(tmp_path, bias=False)
  records = plot_run.load_records(str(tmp_path))
  for r in records:
    r["drop_rate"], r["overflow_rate"] = [0.0] * LAYERS, [0.0] * LAYERS
  ax = _axes_by_title(plot_run.draw(records, "run"))["drops and overflow (% of all token-choices, mean over MoE layers)"]
  assert all(list(line.get_ydata()) == [0.0] * STEPS for line in ax.get_lines())
  assert ax.get_ylim() == (0.0, 1.0) and [t.get_text() for t in ax.texts] == ["none in any step"]

def test_missing_or_empty_runs_raise_one_line(tmp_path):
  with pytest.raises(plot_run.RunError, match="no such workdir"):
    plot_run.load_records(str(tmp_path / "nope"))
  with pytest.raises(plot_run.RunError, match="metrics.jsonl does not exist"):
    plot_run.load_records(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss"')  # only a torn line
  with pytest.raises(plot_run.RunError, match="holds no complete step record"):
    plot_run.load_records(str(tmp_path))


def _command(*args):
  return subprocess.run([sys.executable, "-m", "experiments.plot_run", *map(str, args)], env=ENV,
                        capture_output=True, text=True, timeout=120)


def test_command_writes_the_png_and_errors_are_one_line(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  _write_run(run, bias=False)
  done = _command(f"--workdir={run}")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == f"wrote {run / 'curves.png'} (no data: expert bias range)"
  assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1  # left as it was
  done = _command(f"--config.run={run}", f"--workdir={tmp_path / 'plots'}")  # another run's curves, written apart
  assert done.returncode == 0 and done.stdout.startswith(f"wrote {tmp_path / 'plots' / 'curves.png'}"), done.stderr

  for workdir, message in ((tmp_path / "nope", f"error: no such workdir: {tmp_path / 'nope'}"),
                           (tmp_path, f"error: {tmp_path / 'metrics.jsonl'} does not exist")):
    done = _command(f"--workdir={workdir}")
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr
