"""The hosts of a sweep's job (moejax.study.hosts): one process keeps today's measured meshes; whole hosts of a job of
several processes form a mesh row each; and experiments.scaling run as two processes (gloo, 2 x 4) times the 1 x 4
and 2 x 4 points with the single process's losses, calibrated and drawn beside the model; a job run twice on one
persistent compilation cache finishes both times."""

import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from configs import scaling_default
from moejax.cost import fitted
from moejax.study import hosts, sweep_timing
from moejax.study.points import Point, validate
from moejax.study.sweep import measured_points
from tests.helpers import ENV, ROOT


def test_one_process_forms_meshes_of_its_own_devices(devices):
  assert hosts.leader() and hosts.devices_by_host("cpu") == [sorted(devices, key=lambda d: d.id)]
  assert hosts.mesh_devices(1, 4, "cpu") == list(devices[:4])
  assert hosts.mesh_devices(2, 4, "cpu") == list(devices)  # simulated CPU devices stand for nodes
  assert hosts.mesh_devices(4, 4, "cpu") is None  # 16 devices: more than there are
  assert hosts.mesh_devices(1, 1, "gpu") is None and hosts.devices_by_host("gpu") == []  # no such backend here
  assert hosts.takes_part(devices[:1]) and hosts.agree([True, False, True]) == [True, False, True]
  hosts.barrier("nothing to wait for")


class _Device:
  def __init__(self, id_, process):
    self.id, self.process_index = id_, process


@pytest.mark.parametrize(
  "n, m, rows",
  [(1, 4, [[0, 1, 2, 3]]), (2, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]), (2, 2, [[0, 1], [4, 5]]), (3, 4, None), (1, 8, None)],
)
def test_several_processes_put_a_host_on_each_mesh_row(monkeypatch, n, m, rows):
  """Two hosts of 4 GPUs (ids 0-3 on process 0, 4-7 on process 1, listed out of order): row i is m devices of host
  i; more rows than hosts, or more devices than a host has, form no mesh."""
  job = [_Device(i, i // 4) for i in (5, 1, 0, 7, 3, 2, 6, 4)]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "devices", lambda platform: job)
  got = hosts.mesh_devices(n, m, "gpu")
  assert (None if got is None else [d.id for d in got]) == (None if rows is None else sum(rows, []))


def test_measured_points_are_those_the_job_can_form(devices):
  config = scaling_default.get_config()
  config.nodes, config.gpus_per_node = (1, 2, 4), (4,)
  config.global_batch = 1024
  config.measure.platform = "cpu"
  measured = measured_points(config, validate(config))
  assert {(p.mesh, p.label) for p in measured} == {("1x4", "measured"), ("2x4", "measured")}
  config.measure.platform = "gpu"  # none on a CPU machine
  assert measured_points(config, validate(config)) == []


def _two_host_config() -> ml_collections.ConfigDict:
  """A tiny sweep: flat dropless, weak scaling, 1 and 2 nodes of 4 devices, timed on CPU, calibrated first."""
  config = scaling_default.get_config()
  config.update(nodes=(1, 2), gpus_per_node=(4,), schemes=("flat_dropless",), scalings=("weak",))
  config.models.small.update(d_model=32, d_ff=64, layers=2, moe_layers=1, seq_len=8, micro_batch=2, vocab=100)
  config.measure.update(platform="cpu", warmup=1, repeats=1, max_repeats=3, layer_max_repeats=3)
  config.sim.update(tokens_per_gpu=8, batches=1, d_model=16, d_ff=32)
  config.calibration.update(source="measure", rows=(4, 16))
  return config


def _flags(config) -> list[str]:
  """`_two_host_config` as experiments.scaling's overrides of configs/scaling_default.py."""
  small = config.models.small
  return [
    "--config.nodes=1,2",
    "--config.gpus_per_node=4",
    "--config.schemes=flat_dropless",
    "--config.scalings=weak",
    "--config.measure.platform=cpu",
    "--config.measure.warmup=1",
    "--config.measure.repeats=1",
    "--config.measure.max_repeats=3",
    "--config.measure.layer_max_repeats=3",
    "--config.calibration.source=measure",
    "--config.calibration.rows=4,16",
    *(
      f"--config.models.small.{k}={small[k]}"
      for k in ("d_model", "d_ff", "layers", "moe_layers", "seq_len", "micro_batch", "vocab")
    ),
    *(f"--config.sim.{k}={config.sim[k]}" for k in ("tokens_per_gpu", "batches", "d_model", "d_ff")),
  ]


@pytest.mark.slow  # two processes compile and time two training steps, exchanges and small runs: minutes on 2 cores
def test_two_processes_time_whole_hosts_with_one_process_losses(devices, tmp_path):
  config = _two_host_config()
  workdir = tmp_path / "two_hosts"
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "moejax.runtime.launch",
      "--processes",
      "2",
      "--devices-per-process",
      "4",
      "--timeout",  # below pytest's 300 s: the job is killed and its output shown, not left running
      "270",
      "--",
      sys.executable,
      "-m",
      "experiments.scaling",
      f"--workdir={workdir}",
      *_flags(config),
    ],
    cwd=ROOT,
    env=ENV,
    capture_output=True,
    text=True,
    timeout=290,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = json.loads((workdir / "results.json").read_text())["rows"]
  measured = {r["nodes"]: r for r in rows if r["label"] == "measured"}
  modelled = {r["nodes"]: r for r in rows if r["label"] == "modelled"}
  assert sorted(measured) == sorted(modelled) == [1, 2]
  assert [measured[n]["hosts"] for n in (1, 2)] == [1, 2]  # 2 x 4: a row on each process
  for n, row in measured.items():
    assert row["layer_error"] == pytest.approx(modelled[n]["layer_ms"] / row["layer_ms"] - 1)
    assert row["step_error"] == pytest.approx(modelled[n]["step_s"] / row["step_s"] - 1)
    # The single process's step on its first n x 4 simulated devices: the same model, batch and seeds. Its
    # collectives are in-process copies where the job's are gloo's, which add in another order (float32 rounding).
    point = Point("flat_dropless", n, 4, "small", "weak", "measured")
    want = sweep_timing.training_step(point, config, jax.devices()[: n * 4])["losses"]
    np.testing.assert_allclose([row["loss_first"], row["loss_last"]], [want[0], want[-1]], rtol=0, atol=1e-5)
  assert (workdir / "measured.png").read_bytes()[:4] == b"\x89PNG"
  record = json.loads((workdir / "calibration.json").read_text())
  assert {(e["axis"], e["nodes"]) for e in record["exchanges"]} == {("gpu", 1), ("node", 2), ("both", 2)}
  held_out = fitted.load(str(workdir / "calibration.json"), fitted.topology_lib.get("p4d_efa")).fit["held_out"]
  assert len(held_out) == 2 and all(np.isfinite(e["error"]) for e in held_out)  # both axes, 2 row counts
  assert "calibrated topology" in run.stdout and "measured weak" in run.stdout
  assert os.path.exists(workdir / "points.jsonl")


@pytest.mark.slow  # two 2-process jobs, each compiling the tiny training step: about 40 s on 2 cores
def test_a_job_run_twice_with_a_compilation_cache_does_not_hang(tmp_path):
  """The second job's process 0 could load the step from the persistent cache while process 1 compiled it: that job
  hung in the step (moejax.runtime.distributed.initialize turns the cache off in a local job)."""
  env = {
    **ENV,
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }
  command = [sys.executable, "-m", "moejax.runtime.launch", "--timeout", "150", "--"]
  command += [sys.executable, "tests/programs/cached_step.py"]
  runs = [subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200) for _ in range(2)]
  losses = []
  for run in runs:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses += [json.loads(line.partition("RESULT ")[2]) for line in run.stdout.splitlines() if "RESULT " in line]
  assert len(losses) == 4 and all(got == losses[0] for got in losses)  # both processes, both jobs
