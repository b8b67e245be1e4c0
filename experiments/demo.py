"""Runs one MoE layer on a ('node', 'gpu') mesh, reports its statistics and checks it against the reference.

  python -m experiments.demo                                   # embedded default: configs/demo.py
  python -m experiments.demo --config.moe.path=gpu_first --config.moe.capacity_factor=1.25
  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.demo
  python -m experiments.demo --config.moe.buffer_factor=0.05      # bounded receive buffers that overflow
  python -m experiments.demo --workdir=/tmp/demo                  # also writes demo.npz (y, x, the aux statistics)

Without GPUs (or with JAX_PLATFORMS=cpu) the mesh is made of simulated CPU devices. The mesh is config.mesh
alone; moe fields that must agree with it are checked (configs/demo.py). moe.esp_schedule='auto' is resolved
here for config.tokens on this mesh and the choice printed. The report shows the token-choices dropped by
capacity (moe.capacity_factor) beside those that overflowed bounded receive buffers (moe.buffer_factor), and
when the output differs from the reference it says which of the two explains it.
"""

import os
import statistics
import sys
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import cli
from moejax.cost import expert_backend, parm
from moejax.moe import collective as collective_lib
from moejax.moe import expert_sharding
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import init_params, param_specs
from moejax.moe.reference import moe_reference
from moejax.moe.traffic import traffic_summary
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES
from moejax.validation import ConfigError, check_against_mesh, prefixed, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "demo.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Experiment config file.")
_WORKDIR = cli.define_workdir("Directory for demo.npz (optional: without it, the report only).", required=False)


def validate(config) -> MoEConfig:
  """All checks that need no devices; returns the layer config, moe.esp_schedule='auto' resolved for
  config.tokens on the mesh (Parm's Algorithm 1, `moejax.cost.parm.resolve_auto`). Errors name the field as the
  config spells it (moe.<field>, mesh.<field>)."""
  for field in ("nodes", "gpus_per_node"):
    value = config.mesh[field]
    require(isinstance(value, int) and value >= 1, f"mesh.{field}", value, "a positive int")
  devices = config.mesh.nodes * config.mesh.gpus_per_node
  require(
    isinstance(config.tokens, int) and config.tokens >= devices and config.tokens % devices == 0,
    "tokens",
    config.tokens,
    f"a positive multiple of the mesh's {devices} devices",
  )
  require(isinstance(config.steps, int) and config.steps >= 1, "steps", config.steps, "a positive int")
  moe = MoEConfig.from_mapping(config.moe.to_dict(), prefix="moe.")
  check_against_mesh(moe, config.mesh.nodes, config.mesh.gpus_per_node)  # no moe field resizes the mesh
  return prefixed("moe.", parm.resolve_auto, moe, config.tokens, config.mesh.nodes, config.mesh.gpus_per_node)


def global_array(value: np.ndarray, mesh, spec) -> jax.Array:
  """A global array from the same host value on every process (each keeps only its shards)."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def run(config) -> dict:
  cfg = validate(config)
  n, m = config.mesh.nodes, config.mesh.gpus_per_node
  if distributed.initialize() == "single":
    mesh_lib.simulate_cpu_devices(n * m)  # Only affects the CPU backend; GPUs are used when present.
  mesh = mesh_lib.make_mesh(n, m)
  collective_lib.check(cfg.collective, platform_lib.of_mesh(mesh), field="moe.collective")  # as the trainer says it
  # The layer's own checks (platform, backend) name MoEConfig's fields: here they are the moe section's.
  cfg = prefixed("moe.", expert_backend.resolve, cfg, config.tokens, mesh, "fwd")  # 'auto': measured here
  logging.info(
    "mesh %s on %d process(es), %s devices; %s",
    dict(mesh.shape),
    jax.process_count(),
    mesh.devices.flat[0].platform,
    cfg,
  )

  host_params = jax.tree.map(np.asarray, init_params(jax.random.key(config.seed), cfg))
  host_x = np.asarray(jax.random.normal(jax.random.key(config.seed + 1), (config.tokens, cfg.d_model)))
  params = jax.tree.map(lambda v, s: global_array(v, mesh, s), host_params, param_specs(cfg))
  x = global_array(host_x, mesh, P(AXES))

  layer = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh))
  start = time.perf_counter()
  compiled = prefixed("moe.", lambda: layer.lower(params, x).compile())
  compile_s = time.perf_counter() - start
  times = []
  for step in range(config.steps):
    start = time.perf_counter()
    y, aux = jax.block_until_ready(compiled(params, x))
    times.append(time.perf_counter() - start)
    logging.info("step %d/%d: %.2f ms", step + 1, config.steps, 1e3 * times[-1])

  y = np.asarray(multihost_utils.process_allgather(y, tiled=True))
  # expert_ids is sharded like the tokens (gathered across processes); the rest are replicated totals.
  aux = {
    k: np.asarray(multihost_utils.process_allgather(v, tiled=True) if k == "expert_ids" else v) for k, v in aux.items()
  }
  result = {
    "y": y,
    "x": host_x,
    "compile_s": compile_s,
    "step_ms": 1e3 * statistics.median(times),
    "esp_schedule": str(cfg.esp_schedule),
    "buffer_factor": str(cfg.buffer_factor),
    "hop_axes": [str(axes) for axes in path_lib.hops(cfg.path)],
    "row_bytes": cfg.d_model * host_x.dtype.itemsize,
    **aux,
  }
  if config.check_reference:
    groups = expert_sharding.of(cfg).token_groups(n, m)  # the capacity groups of the layer's dispatch
    y_ref, aux_ref = jax.jit(lambda p, x: moe_reference(p, x, cfg, dispatch_groups=groups))(host_params, host_x)
    result["relative_error"] = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
    result["aux_loss_error"] = abs(float(aux["aux_loss"]) - float(aux_ref["aux_loss"]))
    result["reference_tokens_dropped"] = int(aux_ref["tokens_dropped"])
  return result


def lost_choices(result: dict, config) -> str:
  """Token-choices the layer did not process: dropped by capacity and overflowed bounded receive buffers."""
  buffers = (
    "worst-case receive buffers"
    if result["buffer_factor"] == "None"
    else f"bounded receive buffers, moe.buffer_factor={result['buffer_factor']}"
  )
  return (
    f"token-choices dropped: {int(result['tokens_dropped'])} (capacity, moe.capacity_factor="
    f"{config.moe.capacity_factor}), overflowed: {int(result['tokens_overflowed'])} ({buffers})"
  )


def explain_difference(result: dict) -> str:
  """Why the output differs from the reference: overflow (bounded buffers), capacity drops that differ from the
  reference's, or neither (a bug)."""
  overflowed, dropped = int(result["tokens_overflowed"]), int(result["tokens_dropped"])
  ref_dropped = result.get("reference_tokens_dropped", dropped)
  reasons = []
  if overflowed:
    reasons.append(
      f"{overflowed} token-choices overflowed the bounded receive buffers (moe.buffer_factor="
      f"{result['buffer_factor']}; the reference has none): raise moe.buffer_factor, or None for "
      "worst-case buffers"
    )
  if dropped != ref_dropped:
    reasons.append(
      f"capacity dropped {dropped} token-choices, the reference {ref_dropped} (moe.capacity_factor): "
      "the capacity groups differ"
    )
  if not reasons:
    return f"neither overflow nor capacity drops explain it ({dropped} dropped as in the reference, 0 overflowed)"
  return "; ".join(reasons)


def report(result: dict, config) -> None:
  d = config.mesh.nodes * config.mesh.gpus_per_node
  if expert_sharding.SHARDINGS[config.moe.esp_schedule].needs_resolving:
    print(
      f"moe.esp_schedule='auto' resolved to {result['esp_schedule']!r} (Parm's Algorithm 1 for "
      f"{config.tokens} tokens on {config.mesh.nodes} x {config.mesh.gpus_per_node}, moe.esp_cost="
      f"{config.moe.esp_cost!r})"
    )
  print(f"compile {result['compile_s']:.2f} s, step {result['step_ms']:.2f} ms (median of {config.steps})")
  print(f"aux_loss {result['aux_loss']:.6f} (load balance {result['load_balance_loss']:.6f}, z {result['z_loss']:.6f})")
  print(lost_choices(result, config))
  counts, choices = result["expert_counts"], validate(config).choices_per_token
  print(f"expert counts (token-choices processed: {int(counts.sum())} of {config.tokens * choices}): {counts.tolist()}")
  summary = traffic_summary(result["traffic_rows"], config.mesh.gpus_per_node, result["row_bytes"])
  for hop, (traffic, axes, split) in enumerate(zip(result["traffic_rows"], result["hop_axes"], summary)):
    print(
      f"hop {hop} over {axes}: {split['inter_node_rows']} rows / {split['inter_node_bytes']} B inter-node, "
      f"{split['intra_node_rows']} rows / {split['intra_node_bytes']} B intra-node (dispatch; combine mirrors it)"
    )
    print(f"  rows sent between devices (row = source, column = destination, {d} devices)")
    for source in range(d):
      print("  " + " ".join(f"{v:5d}" for v in traffic[source]))
  if "relative_error" in result:
    print(f"relative error vs reference: {result['relative_error']:.2e} (tolerance {config.tolerance:.0e})")


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    result = run(config)
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")
  if jax.process_index() == 0:
    report(result, config)
    if _WORKDIR.value:
      os.makedirs(_WORKDIR.value, exist_ok=True)
      np.savez(os.path.join(_WORKDIR.value, "demo.npz"), **{k: np.asarray(v) for k, v in result.items()})
  if result.get("relative_error", 0.0) > config.tolerance:
    sys.exit(
      f"error: output differs from the reference by {result['relative_error']:.2e}: {explain_difference(result)}"
    )


if __name__ == "__main__":
  cli.run(main)
