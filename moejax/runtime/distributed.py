"""Starting JAX's multi-controller runtime, the same way on localhost and on a GPU cluster.

Every process of a multi-process job calls `initialize()` once, before any JAX computation:
- under `python -m moejax.runtime.launch` (local CPU processes) it reads the coordinator address, process
  count and id, and device count that the launcher put in the environment, selects the gloo CPU
  collectives, simulates the requested CPU devices and turns JAX's persistent compilation cache off;
- on a cluster (SLURM, Open MPI, Kubernetes, ...) it calls `jax.distributed.initialize()` with no
  arguments, which detects the job from the scheduler's environment (one process per host);
- otherwise (a single process) it does nothing.
"""

import os
import sys

import jax

from moejax.runtime import mesh as mesh_lib
from moejax.runtime.launch import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

_CLUSTER_MARKERS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


def initialize() -> str:
  """Joins the job this process belongs to; returns 'local', 'cluster' or 'single'."""
  if ENV_COORDINATOR in os.environ:
    mesh_lib.simulate_cpu_devices(int(os.environ[ENV_LOCAL_DEVICES]))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # No persistent compilation cache: its key holds each process's own devices, so only process 0 (the one that
    # writes) ever finds an entry, and with jaxlib 0.10.2 a job whose process 0 loaded the sweep's training step from
    # it hung in that step (moejax.runtime.compile_cache; tests/test_hosts.py runs such a job twice).
    jax.config.update("jax_enable_compilation_cache", False)
    jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORDINATOR],
      num_processes=int(os.environ[ENV_NUM_PROCESSES]),
      process_id=int(os.environ[ENV_PROCESS_ID]),
    )
    return "local"
  if any(marker in os.environ for marker in _CLUSTER_MARKERS):
    jax.distributed.initialize()
    return "cluster"
  return "single"


def exit_with(message: str) -> None:
  """Ends this process with `message` on stderr and exit status 1 (as `sys.exit(message)`). In a job of several
  processes it exits at once, past jax.distributed's shutdown: that waits at a barrier for the other processes, which
  wait in a collective for this one (each until gloo's 30 s timeout, with a traceback that hides the cause); the
  launcher, or the cluster's scheduler, then stops the others."""
  if not (jax.distributed.is_initialized() and jax.process_count() > 1):
    raise SystemExit(message)
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)
