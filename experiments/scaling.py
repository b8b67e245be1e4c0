"""Scaling sweep: routing, path and collective schemes over meshes, model sizes, weak and strong scaling.

  python -m experiments.scaling --workdir=/tmp/scaling                  # configs/scaling_default.py
  python -m experiments.scaling --config=configs/scaling_smile.py --workdir=/tmp/scaling_smile
  python -m experiments.scaling --workdir=/tmp/s --config.schemes="('switch', 'smile')" --config.nodes="(1, 2)"

Each point runs the real MoE layer on a simulated CPU mesh of its shape and prices the traffic it
produced with the cluster cost model at the model's token counts (rows labelled 'modelled'); points
whose mesh fits this machine's devices of measure.platform (single-node meshes on 'gpu', default)
are also timed: one layer forward and a whole training step (rows labelled 'measured'). See
moejax/study/sweep.py.
Finished points are kept in <workdir>/points.jsonl and skipped when the sweep is run again;
results go to results.csv, results.json, throughput.png and breakdown.png in the workdir.
"""

import os
import sys

from absl import logging

from moejax import cli
from moejax.runtime import mesh as mesh_lib
from moejax.study import report
from moejax.study.points import max_devices, validate
from moejax.study.sweep import run
from moejax.validation import ConfigError

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "scaling_default.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Sweep config file.")
_WORKDIR = cli.define_workdir("Directory for finished points and results.")


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    points = validate(config)
    mesh_lib.simulate_cpu_devices(max_devices(points))  # Before JAX starts its backends.
    rows, counts = run(config, _WORKDIR.value)
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")
  logging.info("%d point(s) computed (%d small runs), %d done before", counts["computed"], counts["simulated"],
               counts["skipped"])
  paths = report.write_all(rows, config, _WORKDIR.value)
  print(report.comparison_table(rows))
  print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
  cli.run(main)
