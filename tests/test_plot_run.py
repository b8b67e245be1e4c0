"""experiments/plot_run.py on metrics.jsonl files written by the real MetricWriter: the panels' titles and lines
against values recomputed from the raw step metrics, panels without data, several runs overlaid with the config fields
that differ between them, and one-line errors."""

import json
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from experiments import plot_run
from moejax import run_config
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
    step_metrics = {
      "loss": 5.0 - 0.5 * step,
      "task_loss": 4.9 - 0.5 * step,
      "accuracy": 0.1 * step,
      "aux_loss": 0.01 * step,
      "grad_norm": 1.0,
      "learning_rate": 1e-3 * step,
      "expert_counts": rng.integers(1, 100, size=(layers, experts)),
      "tokens_dropped": rng.integers(0, 20, size=layers),
      "tokens_overflowed": rng.integers(0, 20, size=layers),
    }
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
@pytest.mark.sampled(1)
def test_panels_draw_the_records(tmp_path, bias):
  raw = _write_run(tmp_path, bias)
  records = plot_run.load_records(str(tmp_path))
  fig = plot_run.draw({"run": records})
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
  np.testing.assert_allclose(
    lost["dropped (expert capacity)"].get_ydata(),
    [100 * np.mean(m["tokens_dropped"] / t) for m, t in zip(raw, total)],
    atol=1e-3,
  )
  np.testing.assert_allclose(
    lost["overflowed (receive buffers)"].get_ydata(),
    [100 * np.mean(m["tokens_overflowed"] / t) for m, t in zip(raw, total)],
    atol=1e-3,
  )

  throughput = _lines(axes["throughput (tokens/s)"])
  np.testing.assert_allclose(throughput["tokens/s"].get_ydata(), [1000 / (0.25 * s) for s in steps])

  bias_ax = axes["expert bias range (max - min of each layer's bias, score units)"]
  texts = [t.get_text() for t in bias_ax.texts]
  if bias:
    ranges = _lines(bias_ax)
    for layer in range(LAYERS):
      np.testing.assert_allclose(ranges[f"MoE layer {layer}"].get_ydata(), [m["expert_bias_range"][layer] for m in raw])
    assert not texts and "no data" not in fig.get_suptitle()
  else:
    assert not bias_ax.get_lines()
    assert texts == ["no data: no auxiliary-loss-free balancing (moe.bias_update_rate = 0)"]
    assert fig.get_suptitle().endswith("\nno data: expert bias range")


def test_a_run_with_mtp_modules_draws_their_loss(tmp_path):
  """DeepSeek-V3's multi-token prediction: the loss panel names the total with it and draws the modules' loss."""
  raw = _write_run(tmp_path, bias=False, mtp=True)
  fig = plot_run.draw({"run": plot_run.load_records(str(tmp_path))})
  loss = _lines(_axes_by_title(fig)["loss (cross-entropy, nats)"])
  assert set(loss) == {"total (task + aux + lambda x MTP)", "task", "MTP (mean of the modules)"}
  np.testing.assert_allclose(loss["MTP (mean of the modules)"].get_ydata(), [m["mtp_loss"] for m in raw])


def test_a_run_without_moe_layers_says_which_panels_are_empty(tmp_path):
  _write_run(tmp_path, bias=False, moe=False)
  fig = plot_run.draw({"dense": plot_run.load_records(str(tmp_path))})
  empty = [ax.get_title() for ax in fig.axes if any(t.get_text().startswith("no data") for t in ax.texts)]
  assert [t.split(" (")[0] for t in empty] == ["busiest expert load", "drops and overflow", "expert bias range"]
  assert fig.get_suptitle() == (
    "dense: 6 steps (1 to 6)\nno data: busiest expert load, drops and overflow, expert bias range"
  )


def test_a_run_without_drops_draws_them_at_zero_and_says_so(tmp_path):
  _write_run(tmp_path, bias=False)
  records = plot_run.load_records(str(tmp_path))
  for r in records:
    r["drop_rate"], r["overflow_rate"] = [0.0] * LAYERS, [0.0] * LAYERS
  ax = _axes_by_title(plot_run.draw({"run": records}))[
    "drops and overflow (% of all token-choices, mean over MoE layers)"
  ]
  assert all(list(line.get_ydata()) == [0.0] * STEPS for line in ax.get_lines())
  assert ax.get_ylim() == (0.0, 1.0) and [t.get_text() for t in ax.texts] == ["none in any step"]


def _config(top_k: int, learning_rate: float) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "steps": STEPS,
      "moe": {"top_k": top_k, "path": "flat"},
      "optim": {"learning_rate": learning_rate, "betas": (0.9, 0.95)},
    }
  )


def _two_runs(tmp_path, configs=True) -> tuple[str, str]:
  """Runs a (with the bias) and b (without MoE layers), each with its config.json unless not `configs`."""
  a, b = tmp_path / "a", tmp_path / "b"
  for workdir, config, kind in (
    (a, _config(2, 3e-3), dict(bias=True)),
    (b, _config(4, 0.1), dict(bias=False, moe=False)),
  ):
    workdir.mkdir()
    _write_run(workdir, **kind)
    if configs:
      (workdir / run_config.CONFIG_FILE).write_text(run_config.dumps(config))
  return str(a), str(b)


def test_several_runs_are_overlaid_one_colour_each(tmp_path):
  a, b = _two_runs(tmp_path)
  records = {"a": plot_run.load_records(a), "b": plot_run.load_records(b)}
  fig = plot_run.draw(records, ["a note"])
  loss = _lines(_axes_by_title(fig)["loss (cross-entropy, nats)"])
  assert set(loss) == {"a: total (task + aux)", "a: task", "b: total (task + aux)", "b: task"}
  assert loss["a: task"].get_color() == loss["a: total (task + aux)"].get_color() != loss["b: task"].get_color()
  assert loss["a: task"].get_marker() != loss["b: task"].get_marker()  # equal curves of two runs stay visible
  np.testing.assert_allclose(loss["b: task"].get_ydata(), [r["task_loss"] for r in records["b"]])
  busiest = _lines(_axes_by_title(fig)["busiest expert load (x the mean expert load; 1.0 = balanced)"])
  assert set(busiest) == {"a: MoE layer 0", "a: MoE layer 1", "balanced"}  # b has no MoE layers
  assert fig.get_suptitle() == (
    "a: 6 steps (1 to 6); b: 6 steps (1 to 6)\na note\nno data: busiest expert load "
    "(in b), drops and overflow (in b), expert bias range (in b)"
  )


def test_the_config_fields_that_differ_are_read_from_config_json(tmp_path):
  a, b = _two_runs(tmp_path)
  differences, source = plot_run.compare({"a": a, "b": b}, {})
  assert differences == {"moe.top_k": {"a": 2, "b": 4}, "optim.learning_rate": {"a": 3e-3, "b": 0.1}}
  assert source == "their config.json"
  assert plot_run.difference_lines(differences, source) == [
    "fields that differ (read from their config.json):",
    "  moe.top_k: a 2, b 4",
    "  optim.learning_rate: a 0.003, b 0.1",
  ]


def test_runs_without_config_json_are_compared_by_their_records_and_say_so(tmp_path):
  a, b = _two_runs(tmp_path, configs=False)
  records = {"a": plot_run.load_records(a), "b": plot_run.load_records(b)}
  differences, source = plot_run.compare({"a": a, "b": b}, records)
  assert differences == {"MoE layers": {"a": LAYERS, "b": 0}, "experts per MoE layer": {"a": EXPERTS, "b": 0}}
  assert source.endswith("no config.json in a, b") and source.startswith("what metrics.jsonl shows")


def test_run_config_differences_flatten_sections_and_mark_absent_fields():
  first = {"moe": {"top_k": 2, "dims": [1, 2]}, "seed": 0, "log": {}}
  second = {"moe": {"top_k": 2, "dims": [1, 3]}, "seed": 0, "extra": {"on": True}}
  assert run_config.differences({"x": first, "y": second}) == {
    "moe.dims": {"x": [1, 2], "y": [1, 3]},
    "log": {"x": {}, "y": run_config.ABSENT},
    "extra.on": {"x": run_config.ABSENT, "y": True},
  }
  assert run_config.differences({"x": first, "y": first}) == {}


def test_runs_whose_folders_share_a_name_are_named_by_path():
  assert plot_run.run_names(["/r/a", "/r/b/"]) == ["a", "b"]
  assert plot_run.run_names(["/x/run", "/y/run"]) == ["/x/run", "/y/run"]


def test_missing_or_empty_runs_raise_one_line(tmp_path):
  with pytest.raises(plot_run.RunError, match="no such workdir"):
    plot_run.load_records(str(tmp_path / "nope"))
  with pytest.raises(plot_run.RunError, match="metrics.jsonl does not exist"):
    plot_run.load_records(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss"')  # only a torn line
  with pytest.raises(plot_run.RunError, match="holds no complete step record"):
    plot_run.load_records(str(tmp_path))


def _command(*args):
  return subprocess.run(
    [sys.executable, "-m", "experiments.plot_run", *map(str, args)],
    env=ENV,
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.slow
def test_command_writes_the_png_and_errors_are_one_line(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  _write_run(run, bias=False)
  done = _command(f"--workdir={run}")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == f"wrote {run / 'curves.png'} (no data: expert bias range)"
  assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1  # left as it was
  done = _command(f"--config.runs={run}", f"--workdir={tmp_path / 'plots'}")  # another run's curves, written apart
  assert done.returncode == 0 and done.stdout.startswith(f"wrote {tmp_path / 'plots' / 'curves.png'}"), done.stderr

  for workdir, message in (
    (tmp_path / "nope", f"error: no such workdir: {tmp_path / 'nope'}"),
    (tmp_path, f"error: {tmp_path / 'metrics.jsonl'} does not exist"),
  ):
    done = _command(f"--workdir={workdir}")
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr


@pytest.mark.slow
def test_command_overlays_runs_and_prints_what_differs(tmp_path):
  a, b = _two_runs(tmp_path)
  done = _command(f"--config.runs={a},{b}", f"--workdir={tmp_path / 'both'}")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines() == [
    f"wrote {tmp_path / 'both' / 'curves.png'}",
    "fields that differ (read from their config.json):",
    "  moe.top_k: a 2, b 4",
    "  optim.learning_rate: a 0.003, b 0.1",
  ]
