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
