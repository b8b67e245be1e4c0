"""The 2D ('node', 'gpu') device mesh that every moejax layer runs on.

Axis 'node' is the slow network boundary (one row per host on a GPU cluster); axis 'gpu' holds the
devices of one host, joined by the fast intra-node links. The flat index of mesh position
(node i, gpu j) is `i * m + j`, and global expert e lives on flat device `e // experts_per_gpu`.
"""

from collections.abc import Sequence

import jax
import numpy as np

NODE = "node"
GPU = "gpu"
AXES = (NODE, GPU)


class MeshError(ValueError):
  """A mesh that cannot be built from the devices at hand."""


def simulate_cpu_devices(count: int) -> None:
  """Makes JAX's CPU backend expose `count` devices, for running meshes on a machine without GPUs.

  Must run before JAX creates its backends (before the first array or `jax.devices()` call).
  """
  if not isinstance(count, int) or count < 1:
    raise MeshError(f"simulate_cpu_devices: count must be a positive int, got {count!r}")
  from jax._src import xla_bridge  # The public config update only reports this after the fact.

  if xla_bridge.backends_are_initialized():
    have = jax.device_count()
    if have == count or jax.default_backend() != "cpu":
      return
    raise MeshError(
        f"simulate_cpu_devices({count}): JAX already started its backends with {have} CPU device(s); "
        "call it before any JAX computation, or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={count} in the environment.")
  jax.config.update("jax_num_cpu_devices", count)


def _check_shape(nodes: int, gpus_per_node: int) -> None:
  for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise MeshError(f"make_mesh: {name} must be a positive int, got {value!r}")


def make_mesh(nodes: int, gpus_per_node: int, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """Builds a `nodes x gpus_per_node` mesh with axes ('node', 'gpu').

  devices: explicit devices, used in the given order (row-major: node i holds
    devices[i*m:(i+1)*m]). If None: with several processes, row i is process i's local devices
    (so 'node' is the host boundary and each row must be exactly one host); with one process, the
    first `nodes * gpus_per_node` devices.
  """
  _check_shape(nodes, gpus_per_node)
  need = nodes * gpus_per_node
  if devices is not None:
    devices = list(devices)
    if len(devices) != need:
      raise MeshError(f"make_mesh({nodes}, {gpus_per_node}) needs {need} devices, got {len(devices)} explicit devices")
  elif jax.process_count() > 1:
    devices = _devices_by_host(nodes, gpus_per_node)
  else:
    available = jax.devices()
    if len(available) < need:
      hint = ""
      if jax.default_backend() == "cpu":
        hint = (f"; on CPU call moejax.mesh.simulate_cpu_devices({need}) before any JAX computation "
                f"(or set XLA_FLAGS=--xla_force_host_platform_device_count={need})")
      raise MeshError(f"make_mesh({nodes}, {gpus_per_node}) needs {need} devices but JAX has "
                      f"{len(available)} {jax.default_backend()} device(s){hint}")
    devices = available[:need]
  grid = np.empty((nodes, gpus_per_node), dtype=object)
  for flat, device in enumerate(devices):
    grid[flat // gpus_per_node, flat % gpus_per_node] = device
  return jax.sharding.Mesh(grid, AXES)


def _devices_by_host(nodes: int, gpus_per_node: int) -> list[jax.Device]:
  """All devices, grouped so that row i of the mesh is exactly the devices of process i."""
  by_process: dict[int, list[jax.Device]] = {}
  for device in jax.devices():
    by_process.setdefault(device.process_index, []).append(device)
  if len(by_process) != nodes:
    raise MeshError(f"make_mesh: nodes={nodes} but the job has {len(by_process)} processes (hosts); "
                    "on a cluster each host is one node of the mesh")
  devices = []
  for process in sorted(by_process):
    local = sorted(by_process[process], key=lambda d: d.id)
    if len(local) != gpus_per_node:
      raise MeshError(
          f"make_mesh: gpus_per_node={gpus_per_node} but process {process} has {len(local)} devices; "
          "a host's devices may not be split across rows or mixed with another host's "
          "(pass `devices=` explicitly to override)")
    devices.extend(local)
  return devices


def axis_sizes(mesh: jax.sharding.Mesh) -> tuple[int, int]:
  """(n, m): the number of nodes and of GPUs per node of a ('node', 'gpu') mesh."""
  if tuple(mesh.axis_names) != AXES:
    raise MeshError(f"expected a mesh with axes {AXES}, got {tuple(mesh.axis_names)}")
  return mesh.shape[NODE], mesh.shape[GPU]


def flat_device_index(node, gpu, gpus_per_node: int):
  """Flat index `node * m + gpu` of a mesh position (ints or traced arrays)."""
  return node * gpus_per_node + gpu


def my_flat_index(gpus_per_node: int) -> jax.Array:
  """Flat index of the executing device; only valid inside `shard_map` over both mesh axes."""
  return flat_device_index(jax.lax.axis_index(NODE), jax.lax.axis_index(GPU), gpus_per_node)
