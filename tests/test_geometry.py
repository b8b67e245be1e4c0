"""Mesh geometry (moejax.runtime.mesh) against a brute-force reading of (node, gpu) coordinates."""

import itertools

import numpy as np
import pytest

from moejax.runtime import mesh as mesh_lib

SHAPES = [(1, 1), (1, 4), (2, 4), (4, 2), (3, 5)]
HOPS = [mesh_lib.NODE, mesh_lib.GPU, (mesh_lib.NODE, mesh_lib.GPU)]


def _coords(device, m):
  return device // m, device % m


def _brute_group(s, hop, n, m):
  """Devices that differ from s only along the hop's axes, ordered by their coordinate on those axes."""
  node, gpu = _coords(s, m)
  axes = set(mesh_lib.hop_axes(hop))
  members = [p for p in range(n * m)
             if (mesh_lib.NODE in axes or _coords(p, m)[0] == node) and (mesh_lib.GPU in axes or _coords(p, m)[1] == gpu)]
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
  np.testing.assert_array_equal(mesh_lib.peer_index(np.arange(n * m), hop, m),
                                [_brute_group(s, hop, n, m).index(s) for s in range(n * m)])


@pytest.mark.parametrize("n,m", SHAPES)
def test_node_of_and_crossing(n, m):
  for s in range(n * m):
    assert mesh_lib.node_of(s, m) == _coords(s, m)[0]
  for hop in HOPS:
    crosses = any(_coords(p, m)[0] != _coords(s, m)[0]
                  for s, p in itertools.product(range(n * m), repeat=2) if mesh_lib.same_group(hop, n, m)[s, p])
    assert mesh_lib.crosses_nodes(hop, n) == crosses
  cross, inside = mesh_lib.pair_masks(n * m, m)
  for s, p in itertools.product(range(n * m), repeat=2):
    assert cross[s, p] == (_coords(s, m)[0] != _coords(p, m)[0])
    assert inside[s, p] == (_coords(s, m)[0] == _coords(p, m)[0] and s != p)


@pytest.mark.parametrize("bad", ["nodes", (), ("gpu", "gpu"), ("node", "x")])
def test_bad_hop_is_named(bad):
  with pytest.raises(mesh_lib.MeshError, match="hop"):
    mesh_lib.hop_axes(bad)
