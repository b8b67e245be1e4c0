"""One MoE layer forward on the first host's devices (a 1 x gpus_per_node mesh), timed as `experiments.scaling` times
a measured 1 x m point, with the process's CPU use and context switches per call. Run alone, the layer's collectives
are XLA:CPU's in-process ones; inside a job of several processes (`moejax.runtime.launch`) the other processes wait at
a barrier (idle) and the same program's collectives, all between devices of one process, go through the job's
collectives implementation (gloo): the difference is what that costs a program. Prints a line per statistic and
writes <workdir>/one_host_layer.json (every call's seconds, CPU seconds and context switches; the program's
collectives).

  python -m experiments.one_host_layer --workdir=/tmp/one_host
  python -m moejax.runtime.launch --processes 2 --devices-per-process 4 -- python -m experiments.one_host_layer \
      --workdir=/tmp/one_host_2p
"""

import os
import resource
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.experimental import multihost_utils

from moejax import cli, workdir_guard
from moejax.cost import program
from moejax.moe.layer import moe_apply
from moejax.runtime import distributed, host_allocator
from moejax.runtime import mesh as mesh_lib
from moejax.study import hosts, inputs, points
from moejax.validation import require


def timed_calls(fn, warmup: int, calls: int) -> list[dict]:
  """Per timed call of `fn()` (blocked on): wall 'seconds', the process's 'cpu_s', voluntary and involuntary context
  switches ('switches', 'preempted'), after a compiling call and `warmup` untimed ones."""
  for _ in range(1 + warmup):
    jax.block_until_ready(fn())
  rows = []
  for _ in range(calls):
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    jax.block_until_ready(fn())
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    rows.append(
      dict(
        seconds=seconds,
        cpu_s=after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        switches=after.ru_nvcsw - before.ru_nvcsw,
        preempted=after.ru_nivcsw - before.ru_nivcsw,
      )
    )
  return rows


def main(argv):
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  require(config.scheme in points.SWEEP_SCHEMES, "scheme", config.scheme, f"one of {sorted(points.SWEEP_SCHEMES)}")
  require(config.calls >= 1, "calls", config.calls, ">= 1")
  require(config.warmup >= 0, "warmup", config.warmup, ">= 0")
  host_allocator.retain_freed_memory()  # each run's buffers without page faults, as on a GPU
  if distributed.initialize() == "single":
    mesh_lib.simulate_cpu_devices(config.gpus_per_node)
  devices = hosts.mesh_devices(1, config.gpus_per_node, "cpu")
  require(devices is not None, "gpus_per_node", config.gpus_per_node, "at most the first host's CPU devices")
  if jax.process_index() == 0:
    workdir_guard.claim(workdir, "experiments.one_host_layer", config)
    mesh = mesh_lib.make_mesh(1, config.gpus_per_node, devices=devices)
    cfg = points.scheme_config(config.scheme, 1, config.gpus_per_node, config.moe, config.d_model, config.d_ff)
    params = inputs.layer_params(cfg, mesh, config.seed, jnp.float32, balanced_router=True)
    x = inputs.random_tokens(
      mesh, config.tokens_per_gpu * config.gpus_per_node, cfg.d_model, config.seed + 1, jnp.float32
    )
    compiled = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh)).lower(params, x).compile()
    calls = timed_calls(lambda: compiled(params, x), config.warmup, config.calls)
    found = program.collectives(compiled, mesh)
    median = {key: statistics.median(c[key] for c in calls) for key in calls[0]}
    print(f"{jax.process_count()} process(es), {config.scheme} on 1 x {config.gpus_per_node}, d {config.d_model}: "
          f"median {1e3 * median['seconds']:.1f} ms (min {1e3 * min(c['seconds'] for c in calls):.1f}), "
          f"{median['cpu_s'] / median['seconds']:.2f} cores busy, {median['switches']:.0f} switches and "
          f"{median['preempted']:.0f} preemptions a call, {len(found)} collectives")  # fmt: skip
    record = dict(
      processes=jax.process_count(),
      calls=calls,
      collectives=[dict(kind=c.kind, axes=list(c.axes), bytes=c.bytes, count=c.count) for c in found],
      config=config.to_dict(),
    )
    cli.write_json(workdir, "one_host_layer.json", record)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("one_host_layer")  # the others wait here, idle, while process 0 times


if __name__ == "__main__":
  cli.define_config(
    os.path.join(os.path.dirname(__file__), os.pardir, "configs", "one_host_layer.py"),
    "Config file (configs/one_host_layer.py).",
  )
  cli.define_workdir("Directory of one_host_layer.json.")
  cli.run(main)
