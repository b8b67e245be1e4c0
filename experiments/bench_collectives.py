"""Times all-to-all exchanges on the devices at hand and fits latency/bandwidth terms to them.

Variants, each sending `rows` rows of width d from every device to every device of the mesh:
  flat     jax.lax.all_to_all over ('node', 'gpu') at once
  two_hop  all_to_all over 'gpu', then over 'node' (the hierarchical path)
  padded   moejax.moe.collective.padded_all_to_all: ragged semantics from worst-case fixed blocks
  ragged   jax.lax.ragged_all_to_all (skipped, with the backend's message, where it is missing)
Every variant delivers the same blocks in source order; each output is checked against the first
variant's. Collectives of one mesh axis (Parm's groups when experts go over 'node' and each expert's d_ff
over 'gpu': EP = 'node', ESP = MP = 'gpu'), each checked against a NumPy reference:
  node_a2a        all_to_all over 'node' (A2A_EP)
  gpu_all_gather  all_gather over 'gpu' (AG_ESP, AG_MP)
  gpu_all_reduce  psum over 'gpu' (AR_ESP)
`moejax.cost.parm.alpha_beta_from_bench` turns the fits into Parm's alpha-beta terms. Each size is timed as the median of config.iters calls after config.warmup, then
`moejax.cost.calibrate.fit_latency_bandwidth` fits t = latency + bytes / bandwidth per variant,
where bytes = what one device sends to other devices, summed over hops. On a GPU node the flat fit
gives the cost model's intra-node terms (intra_bw, and intra_latency = latency / (peers - 1) when
the launch cost is folded into the messages). CPU devices are in-process copies: compare variants
within one run, nothing more.

  python -m experiments.bench_collectives --workdir=/tmp/collectives   # CPU, 2 x 4 simulated
  python -m experiments.bench_collectives --workdir=/tmp/collectives_h100 --config.nodes=1 --config.gpus_per_node=8 \\
      --config.d=4096 --config.rows=16,64,256,1024,4096 --config.iters=50   # one GPU node

Every option is a field of configs/bench_collectives.py; the record is <workdir>/collectives.json.
"""

import os
import statistics
import sys

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.bench_collectives import VARIANTS
from kernels import tuning
from moejax import cli
from moejax.cost import calibrate
from moejax.moe import collective
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError, is_int, require

RECORD = "collectives.json"
ALL = mesh_lib.AXES
ONE_AXIS = ("node_a2a", "gpu_all_gather", "gpu_all_reduce")  # checked against `reference`, not the first variant


def _ragged_args(num_devices: int, rows: int, m: int):
  """Offsets and sizes of a uniform ragged exchange: `rows` to every peer, blocks in source order."""
  sizes = jnp.full((num_devices,), rows, jnp.int32)
  offsets = jnp.arange(num_devices, dtype=jnp.int32) * rows
  me = mesh_lib.my_flat_index(m)
  return offsets, sizes, jnp.full((num_devices,), me * rows, jnp.int32), sizes


def local_exchange(variant: str, n: int, m: int, rows: int):
  """x [D * rows, d] (blocks in destination order) -> what the device receives, inside shard_map."""
  num_devices = n * m

  def flat(x):
    return jax.lax.all_to_all(x.reshape(num_devices, rows, -1), ALL, 0, 0).reshape(x.shape)

  def two_hop(x):
    x_nodes_gpus_rows_d = x.reshape(n, m, rows, -1)
    x_nodes_gpus_rows_d = jax.lax.all_to_all(x_nodes_gpus_rows_d, mesh_lib.GPU, 1, 1)
    return jax.lax.all_to_all(x_nodes_gpus_rows_d, mesh_lib.NODE, 0, 0).reshape(x.shape)

  def ragged(x, exchange):
    return exchange(x, jnp.zeros_like(x), *_ragged_args(num_devices, rows, m), axis_name=ALL)

  return {
    "flat": flat,
    "two_hop": two_hop,
    "padded": lambda x: ragged(x, collective.padded_all_to_all),
    "ragged": lambda x: ragged(x, jax.lax.ragged_all_to_all),
    "node_a2a": lambda x: jax.lax.all_to_all(x.reshape(n, -1, x.shape[-1]), mesh_lib.NODE, 0, 0).reshape(x.shape),
    "gpu_all_gather": lambda x: jax.lax.all_gather(x, mesh_lib.GPU, tiled=True),
    "gpu_all_reduce": lambda x: jax.lax.psum(x, mesh_lib.GPU),
  }[variant]


def reference(variant: str, x: np.ndarray, n: int, m: int) -> np.ndarray:
  """What a one-axis variant returns for the global input x [D * D * rows, d] (device s holds block s)."""
  x_nodes_gpus_rows_d = x.reshape(n, m, -1, x.shape[-1])
  if variant == "node_a2a":  # device (i, j) sends its k-th of n blocks to (k, j), which stores it i-th
    return x_nodes_gpus_rows_d.reshape(n, m, n, -1, x.shape[-1]).transpose(2, 1, 0, 3, 4).reshape(x.shape)
  if variant == "gpu_all_gather":  # every GPU of node i: node i's blocks in GPU order
    return np.broadcast_to(x_nodes_gpus_rows_d[:, None], (n, m) + x_nodes_gpus_rows_d.shape[1:]).reshape(
      -1, x.shape[-1]
    )
  return np.broadcast_to(x_nodes_gpus_rows_d.sum(axis=1, keepdims=True), x_nodes_gpus_rows_d.shape).reshape(x.shape)


def bytes_sent(variant: str, n: int, m: int, rows: int, row_bytes: int) -> int:
  """Bytes one device sends to other devices in the exchange, all hops together (the one-axis
  collectives: as NCCL's ring runs them, on an operand of D * rows rows)."""
  num_devices = n * m
  operand = num_devices * rows * row_bytes
  if variant == "node_a2a":
    return (n - 1) * operand // n
  if variant == "gpu_all_gather":
    return (m - 1) * operand
  if variant == "gpu_all_reduce":
    return 2 * (m - 1) * operand // m
  if variant == "two_hop":
    return ((m - 1) * n + (n - 1) * m) * rows * row_bytes
  if variant == "padded":  # every peer block padded to the operand's D * rows rows
    return (num_devices - 1) * num_devices * rows * row_bytes
  return (num_devices - 1) * rows * row_bytes


def run_variant(
  variant: str, mesh, rows: int, d: int, dtype, warmup: int, iters: int
) -> tuple[dict, np.ndarray, np.ndarray]:
  """(timings, output, input): every exchange delivers the same blocks in source order, so their outputs
  must match; the one-axis collectives must match `reference`."""
  n, m = mesh_lib.axis_sizes(mesh)
  body = local_exchange(variant, n, m, rows)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ALL), out_specs=P(ALL)))
  x = jax.device_put(
    jax.random.normal(jax.random.key(rows), (n * m * n * m * rows, d), dtype), NamedSharding(mesh, P(ALL))
  )
  times = tuning.time_call(fn, (x,), warmup, iters)
  return dict(times_s=times, median_s=statistics.median(times)), np.asarray(fn(x)), np.asarray(x)


def check(config) -> None:
  """A ConfigError naming the first field of `config` that cannot be benchmarked."""
  for name in ("nodes", "gpus_per_node", "simulate_cpu_devices", "d"):
    require(is_int(config[name]), name, config[name], "a positive int")
  require(config.rows and all(is_int(r) for r in config.rows), "rows", config.rows, "positive ints")
  require(config.dtype in ("float32", "bfloat16"), "dtype", config.dtype, "float32 or bfloat16")
  bad = [v for v in config.variants if v not in VARIANTS]
  require(not bad, "variants", ",".join(config.variants), f"a subset of {list(VARIANTS)} ({bad} are not)")


def print_fits(fits: dict, n: int, m: int) -> None:
  """Each variant's fitted latency and bandwidth; on one node, the intra-node terms of the cost model they give."""
  print(f"\n{'variant':14s} {'latency us':>11s} {'GB/s':>9s} {'rms rel resid':>14s}")
  for variant, lb in fits.items():
    print(
      f"{variant:14s} {lb.latency_s * 1e6:11.2f} {lb.bandwidth / 1e9:9.3g} {lb.fit.rms_relative:14.1%}"
      + ("" if lb.physical else "  (not physical: negative latency or slope)")
    )
  if "flat" in fits and n == 1 and m > 1:
    lb = fits["flat"]
    print(f"intra-node model terms (measured): intra_bw={lb.bandwidth:.4g},intra_latency={lb.latency_s / (m - 1):.4g}")


def write(config, workdir: str) -> None:
  """Times every variant and row count of `config`, prints the fits and writes the record to `workdir`."""
  check(config)
  mesh_lib.simulate_cpu_devices(config.simulate_cpu_devices)  # only the CPU backend reads it
  mesh = mesh_lib.make_mesh(config.nodes, config.gpus_per_node)
  n, m = config.nodes, config.gpus_per_node
  dtype = jnp.dtype(config.dtype)
  row_bytes = config.d * dtype.itemsize
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), mesh {n} x {m}, jax {jax.__version__}")
  results, fits, first_output = [], {}, {}
  for variant in config.variants:
    points = []
    for rows in config.rows:
      entry = dict(variant=variant, rows_per_peer=rows, bytes_sent=bytes_sent(variant, n, m, rows, row_bytes))
      try:
        timings, output, x = run_variant(variant, mesh, rows, config.d, dtype, config.warmup, config.iters)
        if variant in ONE_AXIS:
          want = reference(variant, x.astype(np.float32), n, m)
          tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
          ok = bool(np.allclose(output.astype(np.float32), want, rtol=tolerance, atol=tolerance * m))
          entry.update(timings, matches_reference=ok)
        else:
          ok = bool(np.array_equal(first_output.setdefault(rows, output), output))
          entry.update(timings, matches_first_variant=ok)
        points.append((entry["bytes_sent"], entry["median_s"]))
        print(
          f"{variant:14s} rows/peer {rows:6d} sent {entry['bytes_sent']:12d} B  {entry['median_s'] * 1e6:10.1f} us"
          + ("" if ok else "  OUTPUT DIFFERS from the " + ("reference" if variant in ONE_AXIS else "first variant"))
        )
      except Exception as e:  # pylint: disable=broad-except
        entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(f"{variant:14s} skipped on {device.platform}: {entry['error']}")
        results.append(entry)
        break
      results.append(entry)
    if len(points) >= 2:
      fits[variant] = calibrate.fit_latency_bandwidth(*zip(*points))

  print_fits(fits, n, m)
  record = dict(
    device_kind=device.device_kind,
    platform=device.platform,
    jax_version=jax.__version__,
    jaxlib_version=jaxlib.__version__,
    mesh=[n, m],
    d=config.d,
    dtype=str(dtype),
    warmup=config.warmup,
    iters=config.iters,
    results=results,
    fits={variant: lb.as_dict() for variant, lb in fits.items()},
  )
  cli.write_json(workdir, RECORD, record)


def main(argv):
  del argv
  try:
    write(flags.FLAGS.config, flags.FLAGS.workdir)
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bench_collectives.py"),
    "Benchmark config file (configs/bench_collectives.py).",
  )
  cli.define_workdir("Directory of collectives.json.")
  cli.run(main)
