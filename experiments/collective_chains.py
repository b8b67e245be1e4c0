"""What a collective costs after another collective of the same program, timed two ways: interleaved with other
programs (each program called once a round, as `moejax.study.arrival_calibration` times its microbenchmarks) and back
to back (each called `repeats` times in a row, as a layer or a step is timed). Per chainable kind and axis set
(`program_calibration.CHAINABLE`, `axis_sets`) a program of 1 and one of `links` collectives of 256 B per device,
each after a small op on the one before's result; the cost per further link is (t_links - t_1) / (links - 1). Also the
host's CPU use while the back-to-back calls run (process CPU seconds per wall second: a busy-waiting thread reads as a
core). Prints a table and writes <workdir>/collective_chains.json.

  python -m experiments.collective_chains --workdir=/tmp/chains
  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.collective_chains \
      --workdir=/tmp/chains_2p

On the 2-process CPU job (2 cores, gloo) a collective over 'gpu' after another cost 0.1-0.9 ms interleaved and about
4 ms back to back, in steps of about 4 ms, while gloo's event loop thread kept one core per process busy
(docs/cost-model.md): the state a program's collectives run in, not their data, set their cost there.
"""

import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import PartitionSpec as P

from moejax import cli, workdir_guard
from moejax.runtime import distributed, host_allocator
from moejax.runtime import mesh as mesh_lib
from moejax.study import interleaved_timing, program_calibration
from moejax.validation import require

BYTES = 256  # per device: a plan's size exchange, a statistic


def chain_program(kind: str, axes: tuple, links: int, mesh):
  """(compiled, args): `links` collectives of `kind` over `axes` on a device's [8, 8] f32 block, each on tanh(x) + 1 of
  the one before's result."""
  one = program_calibration._body(kind, axes, mesh)  # pylint: disable=protected-access

  def body(a):
    for _ in range(links):
      a = one(jnp.tanh(a) + 1.0)
    return a

  everything = tuple(mesh.axis_names)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(everything), out_specs=P(everything)))
  args = program_calibration.placed((jnp.ones((mesh.devices.size * BYTES // 32, 8), jnp.float32),), mesh)
  return fn.lower(*args).compile(), args


def back_to_back(programs: list, repeats: int) -> tuple[list[float], float]:
  """(each program's median over `repeats` calls in a row, the process's CPU seconds per wall second over them)."""
  wall, cpu, medians = time.perf_counter(), time.process_time(), []
  for fn, args in programs:
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      seconds.append(time.perf_counter() - start)
    medians.append(statistics.median(seconds))
  return medians, (time.process_time() - cpu) / (time.perf_counter() - wall)


def per_link(single_s: float, chain_s: float, links: int) -> float:
  """Seconds per collective past the first: (chain - single) / (links - 1)."""
  return (chain_s - single_s) / (links - 1)


def main(argv):
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  host_allocator.retain_freed_memory()  # each run's buffers without page faults, as on a GPU
  if distributed.initialize() == "single":
    mesh_lib.simulate_cpu_devices(config.nodes * config.gpus_per_node)
  require(config.links >= 2, "links", config.links, ">= 2: a collective after another")
  require(config.repeats >= 1, "repeats", config.repeats, ">= 1")
  if jax.process_index() == 0:
    workdir_guard.claim(workdir, "experiments.collective_chains", config)
  mesh = mesh_lib.make_mesh(config.nodes, config.gpus_per_node)
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  keys = [(k, a) for k in program_calibration.CHAINABLE for a in program_calibration.axis_sets(mesh)]
  programs = [chain_program(k, a, n, mesh) for k, a in keys for n in (1, config.links)]
  interleaved = interleaved_timing.medians(programs, config.repeats)
  steady, cores = back_to_back(programs, config.repeats)
  say(f"{'kind':<20}{'axes':<10}{'1 link':>9}{f'{config.links} links':>10}{'per link':>10}"
      f"{'1 link':>9}{f'{config.links} links':>10}{'per link':>10}   (ms: interleaved | back to back)")  # fmt: skip
  rows = []
  for i, (kind, axes) in enumerate(keys):
    ways = {}
    for way, seconds in (("interleaved", interleaved), ("back_to_back", steady)):
      single, chain = seconds[2 * i], seconds[2 * i + 1]
      ways[way] = dict(
        single_ms=1e3 * single, chain_ms=1e3 * chain, per_link_ms=1e3 * per_link(single, chain, config.links)
      )
    rows.append(dict(kind=kind, axes=list(axes), **ways))
    say(f"{kind:<20}{','.join(axes):<10}" + "".join(
      f"{w['single_ms']:>9.2f}{w['chain_ms']:>10.2f}{w['per_link_ms']:>10.2f}" for w in ways.values()
    ), flush=True)  # fmt: skip
  say(f"process {jax.process_index()}'s CPU use while back to back: {cores:.2f} cores")
  if jax.process_index() == 0:
    record = dict(rows=rows, cores_busy_back_to_back=cores, config=config.to_dict(), processes=jax.process_count())
    cli.write_json(workdir, "collective_chains.json", record)


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "collective_chains.py"),
    "Config file (configs/collective_chains.py).",
  )
  cli.define_workdir("Directory of collective_chains.json.")
  cli.run(main)
