"""Scaling sweep: routing, path and collective schemes over meshes, model sizes, weak and strong scaling.

  python -m experiments.scaling --workdir=/tmp/scaling                  # configs/scaling_default.py
  python -m experiments.scaling --config=configs/scaling_smile.py --workdir=/tmp/scaling_smile
  python -m experiments.scaling --workdir=/tmp/s --config.schemes="('switch', 'smile')" --config.nodes="(1, 2)"

Each point runs the real MoE layer on a simulated CPU mesh of its shape and prices the traffic it
produced with the cluster cost model at the model's token counts (rows labelled 'modelled'); points
whose mesh the job's devices of measure.platform can form (one host's GPUs; whole hosts of a job of
several processes) are also timed: one layer forward and a whole training step (rows labelled
'measured'). With calibration.source='measure' the job's all-to-alls and one layer are timed first and
every point is priced with the fitted terms (beyond the timed node counts: 'extrapolated'). See
moejax/study/sweep.py and docs/cost-model.md.

  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.scaling \
      --workdir=/tmp/s2 --config.measure.platform=cpu --config.gpus_per_node=4 --config.nodes=1,2   # 2 hosts
Finished points are kept in <workdir>/points.jsonl and skipped when the sweep is run again; results go to
results.csv, results.json, throughput.png, efficiency.png, breakdown.png and (where points were measured)
measured.png in the workdir, the calibration's timings to calibration.json (docs/cost-model.md, "Reading a sweep's
workdir"). The workdir is the sweep's own: a rerun with the same config resumes (or refreshes the results), one
with any field changed is refused naming it, and the results already there are kept (`moejax.workdir_guard`).
"""

import os
import sys

import jax
from absl import logging

from moejax import cli, workdir_guard
from moejax.runtime import distributed, host_allocator
from moejax.runtime import mesh as mesh_lib
from moejax.study import calibration, hosts, report
from moejax.study import points as points_lib
from moejax.study.points import max_devices, validate
from moejax.study.sweep import run
from moejax.validation import ConfigError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "scaling_default.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Sweep config file.")
_WORKDIR = cli.define_workdir("Directory for finished points and results.")


def claim(config, workdir: str) -> None:
  """The workdir is this sweep's (`moejax.workdir_guard`): one holding another program's outputs, or this sweep's
  with other settings (any config field), is refused before anything is written. The leader, which alone reads
  the workdir, decides for every process of the job."""
  refusal = None
  if hosts.leader():
    try:
      workdir_guard.claim(workdir, workdir_guard.SWEEP, config)
    except ConfigError as e:
      refusal = e
  if hosts.agree([refusal is not None])[0]:
    raise refusal or ConfigError(f"the leader refused --workdir={workdir} (its error says why)", "workdir", workdir)


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  try:
    points = validate(config)
    if config.calibration.source == "measure" or any(p.label == "measured" for p in points):
      host_allocator.retain_freed_memory()  # each timed run's buffers without page faults, as on a GPU
    distributed.initialize()  # a job of several processes (moejax.runtime.launch, a cluster), else nothing
    # The small runs use this process's CPU devices: as many as the largest mesh (before JAX starts its backends).
    mesh_lib.simulate_cpu_devices(max(max_devices(points), jax.config.jax_num_cpu_devices))
    claim(config, workdir)
    if config.calibration.source == "measure":
      record = calibration.measure(config, workdir)  # every process times the exchanges; the leader writes it
      if hosts.leader():  # the only process that prices points; the record may be on its disk alone
        with config.unlocked():
          config.calibration.source = record
    rows, counts = run(config, workdir)
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")
  if not hosts.leader():
    return
  logging.info(
    "%d point(s) computed (%d small runs), %d done before", counts["computed"], counts["simulated"], counts["skipped"]
  )
  paths = report.write_all(rows, config, workdir)
  print(report.comparison_table(rows))
  calibrated = points_lib.calibration(config)
  if calibrated:
    print(report.calibration_text(calibrated))
  print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
  cli.run(main)
