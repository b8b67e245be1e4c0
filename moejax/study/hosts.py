"""The hosts of the job a sweep runs in, and the meshes of whole hosts its points can be timed on.

One process: its own devices, as before multi-host runs were measured (several nodes only on simulated CPU
devices). Several processes (`moejax.runtime.distributed`): a process is a host and a mesh row is one host, so a
point of n nodes is timed on hosts 0 .. n-1 of the job, m devices of each. Every process runs the same sweep: the
processes of the point's hosts run its programs together (SPMD), the others skip them, and all of them meet at a
barrier after each timed point, so that no host starts the next point's programs while one is being timed.
Process 0 (the leader) reads and writes the sweep's records; what it read is broadcast (`agree`), so that every
process skips the same points.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from moejax.runtime import platform as platform_lib


def leader() -> bool:
  """Whether this process reads and writes the sweep's records (process 0)."""
  return jax.process_index() == 0


def devices_by_host(platform: str) -> list[list[jax.Device]]:
  """The job's devices of `platform`, one list per process in process order, each sorted by id ([] if this
  machine has no such backend)."""
  try:
    devices = jax.devices(platform)
  except RuntimeError:  # no such backend
    return []
  hosts = [[] for _ in range(jax.process_count())]
  for device in devices:
    hosts[device.process_index].append(device)
  return [sorted(host, key=lambda d: d.id) for host in hosts]


def mesh_devices(n: int, m: int, platform: str) -> list[jax.Device] | None:
  """The devices of an n x m mesh of whole hosts, row by row (row i on host i), or None where this job cannot
  form it: one process, its first n * m devices of `platform` (n > 1 only on simulated CPU devices,
  `platform.simulates_nodes`); several processes, m devices of each of hosts 0 .. n - 1 (n at most the processes,
  m at most each host's devices)."""
  hosts = devices_by_host(platform)
  if not hosts:
    return None
  if len(hosts) == 1:
    local = hosts[0]
    fits = n * m <= len(local) and (n == 1 or platform_lib.simulates_nodes(platform))
    return local[: n * m] if fits else None
  if n > len(hosts) or any(len(host) < m for host in hosts[:n]):
    return None
  return [device for host in hosts[:n] for device in host[:m]]


def takes_part(devices: list[jax.Device]) -> bool:
  """Whether this process holds one of `devices` (and so runs the programs of a mesh of them)."""
  return any(d.process_index == jax.process_index() for d in devices)


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (nothing to wait for in a single process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def agree(flags: list[bool]) -> list[bool]:
  """The leader's `flags` on every process (the others' are ignored; each passes as many)."""
  if jax.process_count() == 1:
    return list(flags)
  return [bool(f) for f in multihost_utils.broadcast_one_to_all(np.asarray(flags, np.int32))]
