"""The 2D ('node', 'gpu') device mesh that every moejax layer runs on.

Axis 'node' is the slow network boundary (one row per host on a GPU cluster); axis 'gpu' holds the
devices of one host, joined by the fast intra-node links. The flat index of mesh position
(node i, gpu j) is `i * m + j`, and global expert e lives on flat device `e // experts_per_gpu`.

With pipeline parallelism (`make_mesh(..., stages=p)`, p > 1) a third axis 'stage' comes first, outermost:
('stage', 'node', 'gpu'), each stage a ('node', 'gpu') mesh of its own whose geometry (hops, peers, nodes) is the
one below (docs/pipelines.md: why not stages over 'node'). Without it (stages=1, the default) the mesh is 2D.
"""

from collections.abc import Sequence

import jax
import numpy as np

NODE = "node"
GPU = "gpu"
AXES = (NODE, GPU)
STAGE = "stage"


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
      f"XLA_FLAGS=--xla_force_host_platform_device_count={count} in the environment."
    )
  jax.config.update("jax_num_cpu_devices", count)


def _check_shape(nodes: int, gpus_per_node: int, stages: int = 1) -> None:
  for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("stages", stages)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise MeshError(f"make_mesh: {name} must be a positive int, got {value!r}")


def make_mesh(
  nodes: int, gpus_per_node: int, devices: Sequence[jax.Device] | None = None, stages: int = 1
) -> jax.sharding.Mesh:
  """Builds a `nodes x gpus_per_node` mesh with axes ('node', 'gpu'), or with stages > 1 a `stages x nodes x
  gpus_per_node` mesh with axes ('stage', 'node', 'gpu') (stage s holds the s-th block of nodes).

  devices: explicit devices, used in the given order (row-major: node i holds
    devices[i*m:(i+1)*m]). If None: with several processes, row i is process i's local devices
    (so 'node' is the host boundary and each row must be exactly one host); with one process, the
    first `stages * nodes * gpus_per_node` devices.
  """
  _check_shape(nodes, gpus_per_node, stages)
  rows = stages * nodes
  need = rows * gpus_per_node
  if devices is not None:
    devices = list(devices)
    if len(devices) != need:
      raise MeshError(f"make_mesh({nodes}, {gpus_per_node}) needs {need} devices, got {len(devices)} explicit devices")
  elif jax.process_count() > 1:
    devices = _devices_by_host(rows, gpus_per_node)
  else:
    available = jax.devices()
    if len(available) < need:
      hint = ""
      if jax.default_backend() == "cpu":
        hint = (
          f"; on CPU call moejax.runtime.mesh.simulate_cpu_devices({need}) before any JAX computation "
          f"(or set XLA_FLAGS=--xla_force_host_platform_device_count={need})"
        )
      raise MeshError(
        f"make_mesh({nodes}, {gpus_per_node}, stages={stages}) needs {need} devices but JAX has "
        f"{len(available)} {jax.default_backend()} device(s){hint}"
      )
    devices = available[:need]
  grid = np.empty((rows, gpus_per_node), dtype=object)
  for flat, device in enumerate(devices):
    grid[flat // gpus_per_node, flat % gpus_per_node] = device
  if stages == 1:
    return jax.sharding.Mesh(grid, AXES)
  return jax.sharding.Mesh(grid.reshape(stages, nodes, gpus_per_node), (STAGE, *AXES))


def stage_manual(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """The ('stage', 'node', 'gpu') mesh with 'stage' manual: what a module's own shard_map (the MoE layer's) and
  sharding constraints must name inside the pipeline's shard_map over 'stage' (jax 0.10.2 requires a nested
  shard_map's mesh to equal the context's, whose 'stage' axis is manual there)."""
  require_stages(mesh)
  types = (jax.sharding.AxisType.Manual, jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto)
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def require_stages(mesh: jax.sharding.Mesh) -> int:
  """The number of stages of a ('stage', 'node', 'gpu') mesh; MeshError for another mesh."""
  if tuple(mesh.axis_names) != (STAGE, *AXES):
    raise MeshError(f"expected a mesh with axes {(STAGE, *AXES)}, got {tuple(mesh.axis_names)}")
  return mesh.shape[STAGE]


def _devices_by_host(nodes: int, gpus_per_node: int) -> list[jax.Device]:
  """All devices, grouped so that row i of the mesh is exactly the devices of process i."""
  by_process: dict[int, list[jax.Device]] = {}
  for device in jax.devices():
    by_process.setdefault(device.process_index, []).append(device)
  if len(by_process) != nodes:
    raise MeshError(
      f"make_mesh: nodes={nodes} but the job has {len(by_process)} processes (hosts); "
      "on a cluster each host is one node of the mesh"
    )
  devices = []
  for process in sorted(by_process):
    local = sorted(by_process[process], key=lambda d: d.id)
    if len(local) != gpus_per_node:
      raise MeshError(
        f"make_mesh: gpus_per_node={gpus_per_node} but process {process} has {len(local)} devices; "
        "a host's devices may not be split across rows or mixed with another host's "
        "(pass `devices=` explicitly to override)"
      )
    devices.extend(local)
  return devices


def axis_sizes(mesh: jax.sharding.Mesh) -> tuple[int, int]:
  """(n, m): the number of nodes and of GPUs per node of a ('node', 'gpu') mesh (of each stage of a ('stage',
  'node', 'gpu') one)."""
  if tuple(mesh.axis_names) not in (AXES, (STAGE, *AXES)):
    raise MeshError(f"expected a mesh with axes {AXES} or {(STAGE, *AXES)}, got {tuple(mesh.axis_names)}")
  return mesh.shape[NODE], mesh.shape[GPU]


def flat_device_index(node, gpu, gpus_per_node: int):
  """Flat index `node * m + gpu` of a mesh position (ints or traced arrays)."""
  return node * gpus_per_node + gpu


def my_flat_index(gpus_per_node: int) -> jax.Array:
  """Flat index of the executing device; only valid inside `shard_map` over both mesh axes."""
  return flat_device_index(jax.lax.axis_index(NODE), jax.lax.axis_index(GPU), gpus_per_node)


# Geometry: which flat devices exchange in a hop. A hop runs over 'node', over 'gpu', or over both
# axes as one (('node', 'gpu'): the flat exchange); the group of device s holds the devices that
# differ from s only along the hop's axes, and a device's peer index is its position in that group.


def hop_axes(hop) -> tuple[str, ...]:
  """'node' | 'gpu' | ('node', 'gpu') -> the tuple of axis names, checked."""
  axes = (hop,) if isinstance(hop, str) else tuple(hop)
  if not axes or len(set(axes)) != len(axes) or not set(axes) <= set(AXES):
    raise MeshError(f"hop {hop!r} must be one of {AXES} or a tuple of them")
  return axes


def num_peers(hop, nodes: int, gpus_per_node: int) -> int:
  """A, the size of each group of the hop."""
  return int(np.prod([{NODE: nodes, GPU: gpus_per_node}[a] for a in hop_axes(hop)]))


def peer_index(device, hop, gpus_per_node: int):
  """Position of flat `device` (ints or arrays, traced too) within its group of the hop."""
  axes = set(hop_axes(hop))
  if axes == {NODE}:
    return device // gpus_per_node
  if axes == {GPU}:
    return device % gpus_per_node
  return device


def peer_table(hop, nodes: int, gpus_per_node: int) -> np.ndarray:
  """[D, A] int: row s holds the flat devices of s's group of the hop in peer order (s included)."""
  grid = np.arange(nodes * gpus_per_node).reshape(nodes, gpus_per_node)
  axes = set(hop_axes(hop))
  if axes == {NODE}:
    return grid.T[grid.reshape(-1) % gpus_per_node]
  if axes == {GPU}:
    return grid[grid.reshape(-1) // gpus_per_node]
  return np.tile(grid.reshape(-1), (nodes * gpus_per_node, 1))


def same_group(hop, nodes: int, gpus_per_node: int) -> np.ndarray:
  """[A, A] bool: flat devices s and p are in one group of the hop (s == p included)."""
  table = peer_table(hop, nodes, gpus_per_node)
  mask = np.zeros((table.shape[0],) * 2, bool)
  np.put_along_axis(mask, table, True, axis=1)
  return mask


def node_of(device, gpus_per_node: int):
  """The node of flat `device` (ints or arrays)."""
  return device // gpus_per_node


def pair_masks(devices: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
  """([A, A] bool cross-node, [A, A] bool in-node) of flat device pairs (s, p); a device's pair with
  itself is in neither: its rows move no data."""
  node = node_of(np.arange(devices), gpus_per_node)
  cross = node[:, None] != node[None, :]
  return cross, ~cross & ~np.eye(devices, dtype=bool)


def crosses_nodes(hop, nodes: int) -> bool:
  """Whether the hop's exchanges leave the node (any hop over 'node' on more than one node)."""
  return nodes > 1 and NODE in hop_axes(hop)
