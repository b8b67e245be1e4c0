"""Per-phase timing: the phase programs move exactly the layer's traffic; every path's and collective's phases
are classified as the cost model classifies them."""

import jax
import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.params import init_params
from moejax.runtime import mesh as mesh_lib
from moejax.runtime.mesh import AXES
from moejax.study import phase_timing


def _peers(axis, s, n, m):
  """Flat indices of the devices that exchange with flat device s over `axis`, in peer order."""
  node, gpu = divmod(s, m)
  if axis == mesh_lib.NODE:
    return [i * m + gpu for i in range(n)]
  if axis == mesh_lib.GPU:
    return [node * m + j for j in range(m)]
  return list(range(n * m))


@pytest.mark.parametrize("axis", [mesh_lib.NODE, mesh_lib.GPU, AXES])
def test_exchange_phase_delivers_the_hop_traffic(mesh_2x4, axis):
  n, m = 2, 4
  devices = n * m
  rng = np.random.default_rng(3)
  traffic = np.zeros((devices, devices), np.int64)
  for s in range(devices):  # random rows to the peers of each device over this axis only
    traffic[s, _peers(axis, s, n, m)] = rng.integers(0, 4, len(_peers(axis, s, n, m)))
  rows = int(traffic.sum(axis=1).max()) + 2  # some rows are sent nowhere
  out_rows = len(_peers(axis, 0, n, m)) * rows
  sizes = phase_timing.hop_sizes(traffic, axis, n, m)
  for s in range(devices):  # device s's group matrix, rows = sources, columns = destinations
    group = _peers(axis, s, n, m)
    np.testing.assert_array_equal(sizes[s], [[traffic[a, b] for b in group] for a in group])

  values = np.stack([1000 * (s + 1) + np.arange(rows) for s in range(devices)]).astype(np.float32)
  phases = phase_timing._Phases(MoEConfig(num_experts=8, top_k=1, d_model=1, d_ff=1), mesh_2x4)
  send = phases.exchange(axis, out_rows, "dispatch", "padded")
  got, got_ids = send(
    phases.put(values.reshape(-1, 1)), phases.put(values.reshape(-1).astype(np.int32)), phases.put(sizes)
  )
  got, got_ids = np.asarray(got).reshape(devices, out_rows), np.asarray(got_ids).reshape(devices, out_rows)
  for r in range(devices):  # each source's block for r (its rows are sorted by peer), sources in order
    blocks = []
    for s in _peers(axis, r, n, m):
      starts = np.concatenate([[0], np.cumsum(traffic[s, _peers(axis, s, n, m)])])
      p = _peers(axis, s, n, m).index(r)
      blocks.append(values[s, starts[p] : starts[p + 1]])
    want = np.concatenate(blocks)
    np.testing.assert_array_equal(got[r, : len(want)], want)
    assert not got[r, len(want) :].any()
    np.testing.assert_array_equal(got_ids[r, : len(want)], want.astype(np.int32))
    assert (got_ids[r, len(want) :] == -1).all()


@pytest.mark.parametrize(
  "n,m,path,collective,cf",
  [
    (2, 4, "flat", "padded", None),
    (2, 4, "gpu_first", "padded", None),
    (2, 4, "node_first", "padded", 2.0),
    (2, 4, "flat", "capacity", 1.0),
    (2, 4, "gpu_first", "capacity", 1.0),
    (1, 4, "flat", "padded", None),
  ],
)
@pytest.mark.sampled(2)
def test_phases_are_split_by_the_links_they_cross(devices, n, m, path, collective, cf):
  mesh = mesh_lib.make_mesh(n, m)
  cfg = MoEConfig(
    num_experts=2 * n * m,
    top_k=2,
    d_model=16,
    d_ff=32,
    path=path,
    collective=collective,
    capacity_factor=cf,
    routing="bilevel" if path == "node_first" else "topk",
    num_nodes=n,
  )
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (n * m * 16, cfg.d_model))
  got = phase_timing.measure_phases(params, x, cfg, mesh, warmup=1, repeats=2)
  assert got["layer_ms"] >= got["layer_ms_min"] > 0 and got["layer_expert_ms"] > 0
  total = got["layer_inter_node_ms"] + got["layer_intra_node_ms"] + got["layer_expert_ms"] + got["layer_other_ms"]
  assert total == pytest.approx(got["layer_ms"])
  # One node: nothing crosses nodes. Flat exchanges on two nodes cross them (one exchange over
  # both axes); the two-hop paths also have a hop over 'gpu' only.
  assert (got["layer_inter_node_ms"] > 0) == (n > 1)
  assert (got["layer_intra_node_ms"] > 0) == (n == 1 or path != "flat")
