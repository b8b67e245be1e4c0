"""The mesh (moejax.runtime.mesh): its layout and flat index, the errors of bad meshes, and its geometry (peers along a
hop, nodes, crossings) against a brute-force reading of (node, gpu) coordinates."""

import itertools

import jax
import numpy as np
import pytest

from moejax.runtime import mesh as mesh_lib


@pytest.mark.parametrize("n,m", [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1), (2, 2)])
def test_make_mesh_layout_and_flat_index(devices, n, m):
  mesh = mesh_lib.make_mesh(n, m)
  assert mesh.axis_names == ("node", "gpu")
  assert mesh_lib.axis_sizes(mesh) == (n, m)
  for i in range(n):
    for j in range(m):
      assert mesh.devices[i, j] == devices[mesh_lib.flat_device_index(i, j, m)]


def test_my_flat_index_inside_shard_map(devices):
  mesh = mesh_lib.make_mesh(2, 4)
  spec = jax.sharding.PartitionSpec(mesh_lib.AXES)
  out = jax.shard_map(lambda: mesh_lib.my_flat_index(4)[None], mesh=mesh, in_specs=(), out_specs=spec)()
  np.testing.assert_array_equal(np.asarray(out), np.arange(8))


def test_too_many_devices_names_the_fix(devices):
  with pytest.raises(mesh_lib.MeshError, match=r"needs 16 devices.*simulate_cpu_devices\(16\)"):
    mesh_lib.make_mesh(4, 4)


@pytest.mark.parametrize("n,m", [(0, 4), (2, -1), (2.0, 4), (True, 4)])
def test_bad_shape_is_named(n, m):
  with pytest.raises(mesh_lib.MeshError, match="must be a positive int"):
    mesh_lib.make_mesh(n, m)


def test_explicit_devices_must_fit(devices):
  with pytest.raises(mesh_lib.MeshError, match="got 3 explicit devices"):
    mesh_lib.make_mesh(2, 2, devices=devices[:3])
  mesh = mesh_lib.make_mesh(2, 2, devices=devices[4:8])
  assert list(mesh.devices.flat) == list(devices[4:8])


def test_simulating_after_backend_start_is_a_clear_error(devices):
  mesh_lib.simulate_cpu_devices(len(devices))  # The count in force: accepted.
  with pytest.raises(mesh_lib.MeshError, match="already started its backends with 8"):
    mesh_lib.simulate_cpu_devices(4)


def test_wrong_axis_names_rejected(devices):
  other = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("x", "y"))
  with pytest.raises(mesh_lib.MeshError, match="expected a mesh with axes"):
    mesh_lib.axis_sizes(other)


SHAPES = [(1, 1), (1, 4), (2, 4), (4, 2), (3, 5)]
HOPS = [mesh_lib.NODE, mesh_lib.GPU, (mesh_lib.NODE, mesh_lib.GPU)]


def _coords(device, m):
  return device // m, device % m


def _brute_group(s, hop, n, m):
  """Devices that differ from s only along the hop's axes, ordered by their coordinate on those axes."""
  node, gpu = _coords(s, m)
  axes = set(mesh_lib.hop_axes(hop))
  members = [
    p
    for p in range(n * m)
    if (mesh_lib.NODE in axes or _coords(p, m)[0] == node) and (mesh_lib.GPU in axes or _coords(p, m)[1] == gpu)
  ]
  return members  # flat order = (node, gpu) order, which is the peer order on every hop


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("hop", HOPS)
def test_peer_table_same_group_and_peer_index(n, m, hop):
  table = mesh_lib.peer_table(hop, n, m)
  assert table.shape == (n * m, mesh_lib.num_peers(hop, n, m))
  group = mesh_lib.same_group(hop, n, m)
  for s in range(n * m):
    expected = _brute_group(s, hop, n, m)
    assert table[s].tolist() == expected
    assert [p for p in range(n * m) if group[s, p]] == expected
    assert mesh_lib.peer_index(s, hop, m) == expected.index(s)
  np.testing.assert_array_equal(
    mesh_lib.peer_index(np.arange(n * m), hop, m), [_brute_group(s, hop, n, m).index(s) for s in range(n * m)]
  )


@pytest.mark.parametrize("n,m", SHAPES)
def test_node_of_and_crossing(n, m):
  for s in range(n * m):
    assert mesh_lib.node_of(s, m) == _coords(s, m)[0]
  for hop in HOPS:
    crosses = any(
      _coords(p, m)[0] != _coords(s, m)[0]
      for s, p in itertools.product(range(n * m), repeat=2)
      if mesh_lib.same_group(hop, n, m)[s, p]
    )
    assert mesh_lib.crosses_nodes(hop, n) == crosses
  cross, inside = mesh_lib.pair_masks(n * m, m)
  for s, p in itertools.product(range(n * m), repeat=2):
    assert cross[s, p] == (_coords(s, m)[0] != _coords(p, m)[0])
    assert inside[s, p] == (_coords(s, m)[0] == _coords(p, m)[0] and s != p)


@pytest.mark.parametrize("bad", ["nodes", (), ("gpu", "gpu"), ("node", "x")])
def test_bad_hop_is_named(bad):
  with pytest.raises(mesh_lib.MeshError, match="hop"):
    mesh_lib.hop_axes(bad)
