"""The small run of a sweep point: the real layer on a simulated CPU mesh of the point's shape."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.cost import program_price
from moejax.moe.layer import moe_apply
from moejax.runtime import mesh as mesh_lib
from moejax.study.inputs import layer_params, random_tokens
from moejax.study.points import scheme_config

# The small run counts rows: its calls take milliseconds, and XLA's CPU backend optimisations cost about a third of
# each compilation, which is most of a point's time.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def cpu_mesh(n: int, m: int) -> jax.sharding.Mesh:
  """An n x m mesh of this process's simulated CPU devices (also on a GPU machine, and in a job of several
  processes, where the leader runs the small runs alone)."""
  cpus = jax.local_devices(backend="cpu")
  if len(cpus) < n * m:
    raise mesh_lib.MeshError(
      f"mesh {n}x{m} needs {n * m} CPU devices, this process has {len(cpus)}; call "
      f"moejax.runtime.mesh.simulate_cpu_devices({n * m}) before any JAX computation"
    )
  return mesh_lib.make_mesh(n, m, devices=cpus[: n * m])


def check_priced(compiled, mesh, cfg, scheme: str) -> None:
  """Refuses a compiled layer whose exchanges the modelled row would not price: the row prices its path's hops
  (`cost.model.price_from_traffic`) and every other collective as control (`program_price.control_collectives`)."""
  missed = program_price.unpriced_exchanges(compiled, mesh, cfg.path_kind.hops)
  if missed:
    names = [f"{c.kind} {c.name} over {','.join(c.axes)}" for c in missed]
    raise ValueError(
      f"scheme {scheme!r}: the layer runs exchanges its path's hops {cfg.path_kind.hops} do not price: {names}"
    )


def simulate(scheme: str, n: int, m: int, config, moe) -> dict:
  """The real layer on a simulated n x m CPU mesh: sim.batches calls of sim.tokens_per_gpu tokens per
  device (one compilation; more batches, less sampling noise in the routing fractions). `moe`: the model's moe
  section (`points.moe_section`).

  The rows travel in float32 (dtype, dispatch_dtype and combine_dtype unset): the wire's dtypes change what a row
  costs, which the pricing counts (`moe.wire.layer_row_bytes`), not which rows move.

  Returns, summed over the batches and as JSON-ready lists: traffic_rows [hops, A, A] (rows out per hop: with
  dedup one per token and destination of the hop), rows_per_device [A] (token-choices each device's experts
  got), dropped (token-choices), tokens_per_gpu; control: the compiled layer's collectives that carry no rows
  (`cost.program_price.control_collectives`: its plan all-gathers and statistics all-reduces, whose sizes do not
  depend on the tokens or the widths, priced as they are); and seconds (compile and run).
  """
  cfg = scheme_config(scheme, n, m, moe, config.sim.d_model, config.sim.d_ff)
  cfg = dataclasses.replace(cfg, dtype="float32", dispatch_dtype=None, combine_dtype=None)
  mesh = cpu_mesh(n, m)
  start = time.perf_counter()
  params = layer_params(cfg, mesh, config.sim.seed, jnp.float32, config.sim.balanced_router)
  batches = [
    random_tokens(mesh, n * m * config.sim.tokens_per_gpu, cfg.d_model, config.sim.seed + 1 + b, jnp.float32)
    for b in range(config.sim.batches)
  ]
  apply = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, batches[0]).compile(COMPILER_OPTIONS)
  check_priced(apply, mesh, cfg, scheme)
  traffic, counts, dropped = 0, 0, 0
  for x in batches:
    _, aux = jax.block_until_ready(apply(params, x))
    traffic = traffic + np.asarray(aux["traffic_rows"], np.int64)
    counts = counts + np.asarray(aux["expert_counts"], np.int64)
    dropped += int(aux["tokens_dropped"])
  return {
    "traffic_rows": traffic.tolist(),
    "rows_per_device": counts.reshape(n * m, -1).sum(axis=1).tolist(),
    "dropped": dropped,
    "tokens_per_gpu": config.sim.batches * config.sim.tokens_per_gpu,
    "control": program_price.control_collectives(apply, mesh),
    "seconds": time.perf_counter() - start,
  }
