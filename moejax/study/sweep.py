"""Scaling sweeps: routing, path and collective schemes over meshes, model sizes, weak and strong scaling.

Every point (scheme, mesh n x m, model, scaling) runs the real layer (`moe_apply`) on a simulated
CPU mesh of that shape with few tokens, then the cluster cost model (`moejax.cost`) prices it at
the model's real shapes and token counts. Such rows are labelled 'modelled'. Points whose mesh the job's devices
of measure.platform can form (one host's, or whole hosts of a multi-process job: `hosts`) are also timed end to
end (`moejax.study.sweep_timing`: a layer forward and a real training step of `moejax.models`); those rows are labelled 'measured'.

Modules of moejax.study: `points` (the config checked, its points and their keys), `inputs` (the
layer's parameters and tokens), `simulate` (the small run), `price` (the modelled row: how the small
run is scaled up, the step model, weak and strong scaling), `moejax.study.sweep_timing` (the measured row), `store`
(the workdir's records), `hosts` (the job's hosts); `run` here runs them all, logging each point with an ETA
(`progress`).
"""

import dataclasses
import os
import time
from collections import Counter

from absl import logging

from moejax.study import hosts
from moejax.study.points import moe_section, point_key, simulated_scheme, simulation_key, validate
from moejax.study.price import model_row, price_point_layer
from moejax.study.progress import Progress
from moejax.study.simulate import simulate
from moejax.study.store import POINTS_FILE, SIMULATIONS_FILE, append, load_jsonl
from moejax.study.sweep_timing import measure


def measured_points(config, points) -> list:
  """The points also timed on this job's devices of measure.platform (`hosts.mesh_devices`), of the models in
  measure.models (all if empty), labelled 'measured'."""
  models = tuple(config.measure.models) or tuple(config.models)
  return [
    dataclasses.replace(p, label="measured")
    for p in points
    if p.model in models and hosts.mesh_devices(p.nodes, p.gpus_per_node, config.measure.platform)
  ]


def run(config, workdir: str) -> tuple[list[dict], dict]:
  """Runs every point not yet stored in workdir/points.jsonl, appending each as it finishes; small
  runs are kept in workdir/simulations.jsonl, so a point that only reprices one reruns nothing.

  Every process of the job runs this. The measured points come first; those holding a point's devices time it
  together (`hosts`), and every process skips the points the leader (process 0) has stored. The leader alone reads
  and writes the workdir and then computes the modelled points, whose small runs use its own CPU devices. Schemes
  that move another scheme's rows (the overlap schedules) reuse its small run; Parm's expert-sharding schemes need
  none (`points.simulated_scheme`).

  Returns (rows of this config's points in run order, counts of points 'computed' and 'skipped' and of small runs
  'simulated'); on the other processes, no rows and the counts of the measured points.
  """
  modelled = validate(config)
  measured = measured_points(config, modelled)
  leader = hosts.leader()
  points = measured + (modelled if leader else [])
  points_path, sims_path = os.path.join(workdir, POINTS_FILE), os.path.join(workdir, SIMULATIONS_FILE)
  if leader:
    os.makedirs(workdir, exist_ok=True)
  done, sims = (load_jsonl(points_path), load_jsonl(sims_path)) if leader else ({}, {})
  keys = [point_key(point, config) for point in points]
  stored = [key in done for key in keys]
  skip = hosts.agree(stored[: len(measured)]) + stored[len(measured) :]
  rows, counts, measured_layers, program_terms = [], {"computed": 0, "skipped": 0, "simulated": 0}, {}, {}
  progress = Progress(Counter(_kind(point) for point, skipped in zip(points, skip) if not skipped))
  for i, (point, key, skipped) in enumerate(zip(points, keys, skip), 1):
    where = f"[{i}/{len(points)}] {point.scheme} {point.mesh} {point.model} {point.scaling} {point.label}"
    if skipped:
      rows += [done[key]] if leader else []
      counts["skipped"] += 1
      logging.info("%s: done before, skipped", where)
      continue
    start = time.perf_counter()
    if point.label == "measured":
      devices = hosts.mesh_devices(point.nodes, point.gpus_per_node, config.measure.platform)
      row = measure(point, config, measured_layers, devices, program_terms) if hosts.takes_part(devices) else None
      hosts.barrier(key)  # no host starts the next point's programs while this one is timed
    else:
      row = model_row(
        point, config, price_point_layer(_small_run(point, config, sims, sims_path, counts), point, config)
      )
    counts["computed"] += 1
    if not leader:
      logging.info("%s", progress.step(f"{where}: timed with the leader", _kind(point)))
      continue
    row["key"] = key
    with open(points_path, "a") as f:
      append(f, row)
    rows.append(row)
    throughput = f", {row['samples_per_s']:.4g} samples/s" if "samples_per_s" in row else ""
    logging.info(
      "%s",
      progress.step(
        f"{where}: layer {row['layer_ms']:.4g} ms{throughput} ({time.perf_counter() - start:.1f} s)", _kind(point)
      ),
    )
  return rows, counts


def _kind(point) -> str:
  """The point's kind for the ETA: a measured point's time grows with its mesh, a modelled one's barely."""
  return f"measured {point.mesh}" if point.label == "measured" else point.label


def _small_run(point, config, sims: dict, sims_path: str, counts: dict) -> dict | None:
  """The point's small run (None for schemes priced from the config alone), from `sims` or run now and appended
  to the file at sims_path."""
  scheme = simulated_scheme(point.scheme)
  if scheme is None:
    return None
  moe = moe_section(config, point.model)
  sim_key = simulation_key(scheme, point.nodes, point.gpus_per_node, config, moe)
  if sim_key not in sims:
    sims[sim_key] = {**simulate(scheme, point.nodes, point.gpus_per_node, config, moe), "key": sim_key}
    with open(sims_path, "a") as f:
      append(f, sims[sim_key])
    counts["simulated"] += 1
  return sims[sim_key]
