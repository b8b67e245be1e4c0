"""The sweep's calibration step (calibration.source 'measure'): the job's all-to-alls and one MoE layer timed on
measure.platform's devices before the points, so that the cost model prices every point with terms fitted on this
cluster (`moejax.cost.fitted`).

What is timed (every process taking part where it holds the devices, `hosts`; the leader writes
<workdir>/calibration.json):
  exchanges  all_to_all along 'gpu' on one host's first w devices, w = 2, 4, 8, ... up to the widest measured mesh's
             m (two group sizes separate the launch cost from the per-message latency); along 'node' and along both
             axes at once on every measured mesh of n > 1 nodes; each at calibration.rows rows per peer of the
             widest model's d_model in moe.dtype. The exchanges along both axes are held out of the fit.
  layer      the flat dropless layer on one device (`phase_timing.measure_phases`) at the first measured model's
             widths and top-k, with as many experts as the largest measured mesh holds, on its micro batch: its
             expert FFN gives the device rate, its remainder the non-expert seconds per routed byte.
A record of an earlier run with the same settings is reused; delete it to time again.
"""

import dataclasses
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.cost import fitted
from moejax.runtime import mesh as mesh_lib
from moejax.study import hosts, phase_timing
from moejax.study.inputs import layer_params, random_tokens
from moejax.study.points import moe_section, scheme_config, validate
from moejax.study.repeats import Repeats, timed
from moejax.study.sweep import measured_points
from moejax.validation import require

RECORD = "calibration.json"


def _plan(config) -> list[tuple[str, int, int]]:
  """(axis, n, m) of every exchange mesh: 'gpu' on 1 x w for w = 2, 4, ... and the widest m; 'node' and 'both' on
  every measured mesh of n > 1."""
  meshes = sorted({(p.nodes, p.gpus_per_node) for p in measured_points(config, validate(config))})
  if not meshes:
    return []
  widest = max(m for _, m in meshes)
  widths = sorted({2**i for i in range(1, widest.bit_length())} | ({widest} if widest > 1 else set()))
  return [("gpu", 1, w) for w in widths] + [(axis, n, m) for n, m in meshes if n > 1 for axis in ("node", "both")]


def settings(config) -> dict:
  """What a record depends on: a stored one is reused only if these are equal."""
  first = _layer_model(config)
  return dict(
    platform=config.measure.platform,
    plan=_plan(config),
    rows=list(config.calibration.rows),
    d=max(model.d_model for model in config.models.values()),
    dtype=config.moe.dtype,
    warmup=config.measure.warmup,
    repeats=dataclasses.asdict(Repeats.of(config.measure)),
    processes=jax.process_count(),
    layer_model=config.models[first].to_dict(),
    layer_moe=moe_section(config, first).to_dict(),
  )


def _layer_model(config) -> str:
  models = tuple(config.measure.models) or tuple(config.models)
  return models[0]


def _time_exchange(
  axis: str, devices: list, n: int, m: int, rows: int, d: int, dtype, warmup: int, repeats: int
) -> float:
  """Median seconds of all_to_all along `axis` on the n x m mesh of `devices`: every device sends `rows` rows of
  width d to each member of its group."""
  mesh = mesh_lib.make_mesh(n, m, devices=devices)
  hop = fitted.AXES[axis]
  members = mesh_lib.num_peers(hop, n, m)

  def body(x):  # x: [members * rows, d], block p for the member p
    return jax.lax.all_to_all(x.reshape(members, rows, d), hop, 0, 0).reshape(x.shape)

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(mesh_lib.AXES), out_specs=P(mesh_lib.AXES)))
  x = jax.device_put(np.ones((n * m * members * rows, d), dtype), NamedSharding(mesh, P(mesh_lib.AXES)))
  return statistics.median(timed(lambda: fn(x), warmup, repeats, mesh))


def time_exchanges(config) -> list[dict]:
  """Every exchange of the plan (module docstring) as `fitted.Exchange` fields; the leader's clock."""
  d = max(model.d_model for model in config.models.values())
  dtype = jnp.dtype(config.moe.dtype)
  out = []
  for axis, n, m in _plan(config):
    devices = hosts.mesh_devices(n, m, config.measure.platform)
    for rows in config.calibration.rows:
      seconds = None
      if hosts.takes_part(devices):
        seconds = _time_exchange(axis, devices, n, m, rows, d, dtype, config.measure.warmup, Repeats.of(config.measure))
      hosts.barrier(f"calibration {axis} {n}x{m} {rows}")
      out.append(dataclasses.asdict(fitted.Exchange(axis, n, m, rows, d * dtype.itemsize, seconds)))
      logging.info(
        "calibration: all_to_all along %s on %dx%d, %d rows of %d bytes per peer: %s",
        axis,
        n,
        m,
        rows,
        d * dtype.itemsize,
        "-" if seconds is None else f"{seconds * 1e6:.1f} us",
      )
  return out


def time_layer(config) -> dict | None:
  """The flat dropless layer on the leader's first device (module docstring); None on the other processes."""
  name = _layer_model(config)
  model, moe = config.models[name], moe_section(config, name)
  largest = max(measured_points(config, validate(config)), key=lambda p: p.devices)
  device = hosts.mesh_devices(1, 1, config.measure.platform)
  result = None
  if hosts.leader():  # the flat layer of the largest mesh (its expert count), run on one device
    cfg = scheme_config("flat_dropless", largest.nodes, largest.gpus_per_node, moe, model.d_model, model.d_ff)
    mesh = mesh_lib.make_mesh(1, 1, devices=device)
    tokens = model.micro_batch * model.seq_len
    dtype = jnp.dtype(moe.dtype)
    params = layer_params(cfg, mesh, config.sim.seed, dtype, config.sim.balanced_router)
    x = random_tokens(mesh, tokens, cfg.d_model, config.sim.seed + 1, dtype)
    phases = phase_timing.measure_phases(params, x, cfg, mesh, config.measure.warmup, Repeats.of(config.measure))
    result = dict(
      phases,
      model=name,
      rows=tokens * cfg.choices_per_token,
      d_model=cfg.d_model,
      d_ff=cfg.d_ff,
      gated=cfg.gated,
      experts=cfg.num_experts,
      top_k=cfg.top_k,
      itemsize=dtype.itemsize,
      device=device[0].device_kind,
    )
  hosts.barrier("calibration layer")
  return result


def measure(config, workdir: str) -> str:
  """Times the exchanges and the layer (every process calls it) unless <workdir>/calibration.json holds a record of
  the same `settings`; returns its path (written by the leader)."""
  require(
    bool(_plan(config)),
    "calibration.source",
    "measure",
    f"'' or a record: no point of this sweep can be timed on this job's {config.measure.platform} devices",
  )
  path = os.path.join(workdir, RECORD)
  wanted = json.loads(json.dumps(settings(config)))  # tuples as the record keeps them
  stored = None
  if hosts.leader() and os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
  if hosts.agree([stored is not None and stored.get("settings") == wanted])[0]:
    logging.info("calibration: %s has this sweep's settings, reused", path)
    return path
  exchanges, layer = time_exchanges(config), time_layer(config)
  if hosts.leader():
    device = hosts.mesh_devices(1, 1, config.measure.platform)[0]
    record = dict(
      settings=wanted,
      device_kind=device.device_kind,
      platform=device.platform,
      jax_version=jax.__version__,
      exchanges=exchanges,
      layer=layer,
    )
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
      json.dump(record, f, indent=1)
  return path
