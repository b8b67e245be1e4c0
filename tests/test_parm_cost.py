"""Parm's schedules and Algorithm 1 (moejax.cost.parm) against hand computations of the paper's equations."""

import itertools

import numpy as np
import pytest

from moejax.cost import parm
from moejax.cost import topology as topology_lib
from moejax.validation import ConfigError

LAUNCH, INTRA_LAT, INTER_LAT, INTRA_BW, NIC_BW = 11.0, 0.5, 4.0, 40.0, 15.0


def toy(gpus_per_node):
  return topology_lib.custom(
    "p4d_efa",
    name="toy",
    gpus_per_node=gpus_per_node,
    intra_bw=INTRA_BW,
    nic_bw=NIC_BW,
    intra_latency=INTRA_LAT,
    inter_latency=INTER_LAT,
    launch=LAUNCH,
    peak_flops=1.0,
    compute_efficiency=1.0,
  )


def random_terms(rng):
  return {name: parm.AlphaBeta(float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-9))) for name in parm.COLLECTIVES}


def random_layer(rng):
  n_ep, n_esp, n_mp = (int(rng.choice([1, 2, 4, 8])) for _ in range(3))
  return parm.ParmLayer(
    B=int(rng.integers(1, 9)),
    L=int(rng.choice([128, 512, 2048])),
    M=int(rng.integers(64, 4097)),
    H=int(rng.integers(64, 8193)),
    E=n_ep * int(rng.integers(1, 4)),
    k=int(rng.integers(1, 3)),
    f=float(rng.uniform(0.5, 3)),
    n_ep=n_ep,
    n_esp=n_esp,
    n_mp=n_mp,
  )


def paper_times(layer, ab):
  """Eq. (1), (13) and (7) in the paper's symbols, T = k f B L / E (Sec. II-A)."""
  T = layer.k * layer.f * layer.B * layer.L / layer.E
  ETM, BLM = layer.E * T * layer.M, layer.B * layer.L * layer.M
  t = lambda name, x: ab[name].alpha_s + ab[name].beta_s * x  # noqa: E731
  y = ETM * layer.n_esp / layer.n_mp
  return {
    "baseline": t("ag_esp", BLM * layer.n_esp) + t("ar_esp", ETM * layer.n_esp) + 2 * t("a2a_ep", ETM * layer.n_esp),
    "s1": 2 * t("a2a_epesp", y) + t("ag_mp", BLM),
    "s2": t("a2a_epesp", y) + t("overlap", y),
  }


def test_schedule_times_follow_the_papers_equations():
  rng = np.random.default_rng(0)
  for _ in range(200):
    layer, ab = random_layer(rng), random_terms(rng)
    got, want = parm.communication_times(layer, ab), paper_times(layer, ab)
    for schedule in parm.ESP_SCHEDULES:
      assert got[schedule] == pytest.approx(want[schedule], rel=1e-12)
    rate = float(rng.uniform(1e12, 1e15))
    flops = 4 * layer.k * layer.f * layer.B * layer.L * layer.M * layer.H  # baseline: every token N_MP times
    total = parm.layer_times(layer, ab, rate)
    assert total["baseline"] == pytest.approx(want["baseline"] + flops / rate, rel=1e-12)
    assert total["s2"] == pytest.approx(want["s2"] + flops / layer.n_mp / rate, rel=1e-12)


def test_algorithm1_picks_the_brute_force_minimum():
  rng = np.random.default_rng(1)
  picks = set()
  for _ in range(500):
    layer, ab = random_layer(rng), random_terms(rng)
    want = paper_times(layer, ab)
    best = "s1" if want["s1"] <= want["s2"] else "s2"
    assert parm.choose_schedule(layer, ab) == best
    assert parm.layer_times(layer, ab, 1e14)[best] == min(parm.layer_times(layer, ab, 1e14)[s] for s in ("s1", "s2"))
    picks.add(best)
  assert picks == {"s1", "s2"}  # the random cases exercise both branches


def test_alpha_beta_on_one_node_match_hand_terms():
  """8 ranks on one node of 8: N_EP 2 (ranks r, r + 4), N_ESP 4, N_MP 4, 2-byte elements."""
  ab = parm.alpha_beta_from_topology(toy(8), n_ep=2, n_esp=4, n_mp=4, bytes_per_element=2)
  want = {
    "a2a_epesp": (LAUNCH + 7 * INTRA_LAT, 2 * 7 / 8 / INTRA_BW),
    "a2a_ep": (LAUNCH + INTRA_LAT, 2 * 1 / 2 / INTRA_BW),
    "ag_esp": (LAUNCH + 3 * INTRA_LAT, 2 * 3 / 4 / INTRA_BW),
    "ag_mp": (LAUNCH + 3 * INTRA_LAT, 2 * 3 / 4 / INTRA_BW),
    "ar_esp": (LAUNCH + 6 * INTRA_LAT, 2 * 2 * 3 / 4 / INTRA_BW),
    # SAA: the all-to-all of y' and the all-gather of ETM = y' N_MP / N_ESP share the intra-node link
    "overlap": (LAUNCH + 7 * INTRA_LAT + 3 * INTRA_LAT, (2 * 7 / 8 + 2 * 3 / 4) / INTRA_BW),
  }
  for name, (alpha, beta) in want.items():
    assert ab[name].alpha_s == pytest.approx(alpha, rel=1e-12), name
    assert ab[name].beta_s == pytest.approx(beta, rel=1e-9), name


def test_alpha_beta_across_nodes_share_the_nic():
  """8 ranks on 2 nodes of 4, N_ESP 4: each EP pair (r, r + 4) crosses nodes, 4 GPUs share a node's NIC."""
  ab = parm.alpha_beta_from_topology(toy(4), n_ep=2, n_esp=4, n_mp=2, bytes_per_element=4)
  assert ab["a2a_ep"].alpha_s == pytest.approx(LAUNCH + INTER_LAT)
  assert ab["a2a_ep"].beta_s == pytest.approx(4 * 4 / 2 / NIC_BW, rel=1e-9)
  assert ab["a2a_epesp"].alpha_s == pytest.approx(LAUNCH + 3 * INTRA_LAT + 4 * INTER_LAT)
  assert ab["a2a_epesp"].beta_s == pytest.approx(max(4 * 4 * 4 / 8 / NIC_BW, 4 * 3 / 8 / INTRA_BW), rel=1e-9)


def test_dedicated_schedules_never_lose_to_the_baseline_on_parms_testbeds():
  """Eq. (6) and (10): with N_MP = 1 both dedicated schedules, and S2 always, are at least as fast as the baseline.
  The proofs drop the alpha terms (Eq. (10) writes 2 A2A(a) - 2 A2A(b) as A2A(2(a - b))); on NVSwitch nodes (dgx_h100_ib) small layers break them:
  the fused all-to-all over all P ranks pays more messages than the EP one, and bandwidth no longer hides that."""
  for topology in (topology_lib.RTX4090_PCIE, topology_lib.RTX2080TI_IB100):
    for n_mp, n_esp, p in itertools.product((1, 2, 4), (1, 2, 4), (8, 16)):
      ab = parm.alpha_beta_from_topology(topology, p // n_esp, n_esp, n_mp, 2)
      for b, width in ((2, 1024), (8, 4096)):
        layer = parm.ParmLayer(
          B=b, L=1024, M=width, H=width, E=p // n_esp, k=1, f=1.2, n_ep=p // n_esp, n_esp=n_esp, n_mp=n_mp
        )
        times = parm.communication_times(layer, ab)
        assert times["s2"] <= times["baseline"] * (1 + 1e-12)
        if n_mp == 1:
          assert times["s1"] == pytest.approx(times["s2"], rel=1e-12)  # nothing to split or gather
          assert times["s1"] <= times["baseline"] * (1 + 1e-12)
        if n_mp == n_esp == 1:
          assert times["s1"] == pytest.approx(times["baseline"], rel=1e-12)  # plain EP: all three coincide


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(B=0), "B"),
    (dict(f=0.0), "f"),
    (dict(E=3), "E"),
    (dict(n_mp=1.5), "n_mp"),
  ],
)
def test_bad_layers_name_their_field(kwargs, field):
  args = dict(B=2, L=512, M=1024, H=1024, E=2, k=1, f=1.2, n_ep=2, n_esp=2, n_mp=2) | kwargs
  with pytest.raises(ConfigError, match=field):
    parm.ParmLayer(**args)


def test_bad_terms_and_groups_name_their_field():
  with pytest.raises(ConfigError, match="alpha_s"):
    parm.AlphaBeta(-1.0, 0.0)
  layer = parm.ParmLayer(B=2, L=512, M=1024, H=1024, E=2, k=1, f=1.2, n_ep=2, n_esp=2, n_mp=2)
  terms = random_terms(np.random.default_rng(2))
  del terms["overlap"]
  with pytest.raises(ConfigError, match="alpha_beta"):
    parm.choose_schedule(layer, terms)
  with pytest.raises(ConfigError, match="n_mp"):
    parm.alpha_beta_from_topology(toy(8), n_ep=3, n_esp=1, n_mp=2, bytes_per_element=2)
  with pytest.raises(ConfigError, match="rate"):
    parm.layer_times(layer, random_terms(np.random.default_rng(3)), 0.0)


def test_alpha_beta_from_a_bench_collectives_record():
  """Fits on bytes sent to other devices, mesh 2 x 4: x -> bytes sent by the ring / pairwise factors."""
  fits = {"flat": (5e-6, 10e9), "node_a2a": (3e-6, 4e9), "gpu_all_gather": (2e-6, 20e9), "gpu_all_reduce": (4e-6, 30e9)}
  record = {
    "mesh": [2, 4],
    "fits": {v: {"latency_s": a, "bandwidth": bw, "physical": True} for v, (a, bw) in fits.items()},
  }
  ab = parm.alpha_beta_from_bench(record, bytes_per_element=2)
  assert ab["a2a_epesp"].beta_s == pytest.approx(2 * 7 / 8 / 10e9)  # 8 ranks: 7/8 of x leaves the device
  assert ab["a2a_ep"].beta_s == pytest.approx(2 * 1 / 2 / 4e9)
  assert ab["ag_mp"].beta_s == ab["ag_esp"].beta_s == pytest.approx(2 * 3 / 4 / 20e9)
  assert ab["ar_esp"].beta_s == pytest.approx(2 * 2 * 3 / 4 / 30e9)
  assert ab["overlap"].alpha_s == pytest.approx(7e-6)
  assert ab["overlap"].beta_s == pytest.approx(2 * 7 / 8 / 10e9 + 2 * 3 / 4 / 20e9)
  del record["fits"]["node_a2a"]
  with pytest.raises(ConfigError, match="node_a2a"):
    parm.alpha_beta_from_bench(record, 2)
