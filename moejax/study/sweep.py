"""Scaling sweeps: routing, path and collective schemes over meshes, model sizes, weak and strong scaling.

Every point (scheme, mesh n x m, model, scaling) runs the real layer (`moe_apply`) on a simulated
CPU mesh of that shape with few tokens, then the cluster cost model (`moejax.cost`) prices it at
the model's real shapes and token counts. Such rows are labelled 'modelled'. Points whose mesh fits
this machine's devices of measure.platform are also timed end to end (`measure`: a layer forward
and a real training step of `moejax.models`); those rows are labelled 'measured'.

Modules of moejax.study: `points` (the config checked, its points and their keys), `inputs` (the
layer's parameters and tokens), `simulate` (the small run), `price` (the modelled row: how the small
run is scaled up, the step model, weak and strong scaling), `measure` (the measured row), `store`
(the workdir's records); `run` here runs them all.
"""

import dataclasses
import os
import time

from absl import logging

from moejax.study.measure import fits_real_devices, measure
from moejax.study.points import point_key, simulated_scheme, simulation_key, validate
from moejax.study.price import model_row, price_point_layer
from moejax.study.simulate import simulate
from moejax.study.store import POINTS_FILE, SIMULATIONS_FILE, append, load_jsonl


def run(config, workdir: str) -> tuple[list[dict], dict]:
  """Runs every point not yet stored in workdir/points.jsonl, appending each as it finishes; small
  runs are kept in workdir/simulations.jsonl, so a point that only reprices one reruns nothing.

  Schemes that move another scheme's rows (the overlap schedules) reuse its small run; Parm's
  expert-sharding schemes need none (`points.simulated_scheme`).

  Returns (rows of this config's points in run order, counts of points 'computed' and 'skipped'
  and of small runs 'simulated').
  """
  points = validate(config)
  points += [dataclasses.replace(p, label="measured") for p in points
             if fits_real_devices(p.nodes, p.gpus_per_node, config.measure.platform)]
  os.makedirs(workdir, exist_ok=True)
  points_path, sims_path = os.path.join(workdir, POINTS_FILE), os.path.join(workdir, SIMULATIONS_FILE)
  done, sims = load_jsonl(points_path), load_jsonl(sims_path)
  rows, counts, measured_layers = [], {"computed": 0, "skipped": 0, "simulated": 0}, {}
  with open(points_path, "a") as point_file, open(sims_path, "a") as sim_file:
    for i, point in enumerate(points, 1):
      key = point_key(point, config)
      where = f"[{i}/{len(points)}] {point.scheme} {point.mesh} {point.model} {point.scaling} {point.label}"
      if key in done:
        rows.append(done[key])
        counts["skipped"] += 1
        logging.info("%s: done before, skipped", where)
        continue
      start = time.perf_counter()
      if point.label == "measured":
        row = measure(point, config, measured_layers)
      else:
        sim, scheme = None, simulated_scheme(point.scheme)
        if scheme is not None:
          sim_key = simulation_key(scheme, point.nodes, point.gpus_per_node, config)
          if sim_key not in sims:
            sims[sim_key] = {**simulate(scheme, point.nodes, point.gpus_per_node, config), "key": sim_key}
            append(sim_file, sims[sim_key])
            counts["simulated"] += 1
          sim = sims[sim_key]
        row = model_row(point, config, price_point_layer(sim, point, config))
      row["key"] = key
      append(point_file, row)
      rows.append(row)
      counts["computed"] += 1
      throughput = f", {row['samples_per_s']:.4g} samples/s" if "samples_per_s" in row else ""
      logging.info("%s: layer %.4g ms%s (%.1f s)", where, row["layer_ms"], throughput,
                   time.perf_counter() - start)
  return rows, counts
