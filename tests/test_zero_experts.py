"""Zero-computation experts (LongCat-Flash, `MoEConfig.zero_experts`): the layer equals the single-device reference
on every path, collective and dedup, with fresh random routing and forced skew; a zero expert's choice moves no row
on any hop (traffic counted independently from the routed ids); the remedies it meets; what it refuses and why."""

import zlib

import numpy as np
import pytest

from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.validation import ConfigError
from tests import helpers

E, Z, N, M, TOKENS, D = 16, 3, 2, 4, 128, 8
# Forced routing: None = the random router's; else every token's first choices (`helpers.force_routing`).
SKEWS = {"random": None, "all_zero": [E, E + 1], "one_real": [5]}


def _config(**fields) -> MoEConfig:
  base = dict(num_experts=E, top_k=2, d_model=D, d_ff=12, zero_experts=Z, renormalize=True, gated=True)
  return MoEConfig(**(base | {"activation": "silu", "z_loss_coef": 1e-3} | fields))


def _inputs(cfg: MoEConfig, skew: str, seed: int):
  params, x = helpers.random_params(cfg, seed), helpers.normal(seed + 1, (TOKENS, D))
  if SKEWS[skew] is not None:
    params, x = helpers.force_routing(params, x, SKEWS[skew])
  return params, x


def expected_traffic(ids_TxK: np.ndarray, path: str, dedup: bool) -> np.ndarray:
  """[hops, A, A] rows each hop should move, from the routed ids alone: a real choice of token t (on device t // (T /
  A)) goes to device id // (E / A) through the path's hops (an intermediate device per two-hop path), once per
  destination of each hop with dedup, once per choice without; a zero expert's choice (id >= E) goes nowhere."""
  devices = N * M
  per_device, per_expert = ids_TxK.shape[0] // devices, E // devices
  traffic = np.zeros((len(path_lib.hops(path)), devices, devices), np.int64)
  for t, ids in enumerate(ids_TxK):
    src = t // per_device
    entries = [set() for _ in traffic] if dedup else None
    for e in ids[ids < E]:
      dest = int(e) // per_expert
      mid = {"gpu_first": src // M * M + dest % M, "node_first": dest // M * M + src % M}.get(path)
      moves = [(src, dest)] if mid is None else [(src, mid), (mid, dest)]
      for hop, move in enumerate(moves):
        if dedup and move in entries[hop]:
          continue
        traffic[hop][move] += 1
        if dedup:
          entries[hop].add(move)
  return traffic


CASES = [
  pytest.param(path, collective, dedup, skew, id=f"{path}-{collective}-dedup{dedup}-{skew}")
  for path in path_lib.PATHS
  for collective in ("padded", "capacity")
  for dedup in (True, False)
  for skew in SKEWS
]


@pytest.mark.parametrize("path,collective,dedup,skew", CASES)
@pytest.mark.sampled(3)
def test_layer_equals_reference_and_zero_choices_never_move(path, collective, dedup, skew, mesh_2x4):
  cfg = _config(
    path=path, collective=collective, dedup=dedup, capacity_factor=1.0 if collective == "capacity" else None
  )
  params, x = _inputs(cfg, skew, seed=zlib.crc32(f"{path}{collective}{dedup}".encode()) % 1000)
  reference = helpers.reference_run(cfg, params, x, mesh_2x4.size)
  y, aux = helpers.assert_matches_reference(cfg, mesh_2x4, params, x, reference=reference)
  np.testing.assert_array_equal(np.asarray(aux["zero_expert_counts"]), np.asarray(reference[1]["zero_expert_counts"]))
  ids = np.asarray(aux["expert_ids"])
  zero_choices = int((ids >= E).sum())
  assert int(np.asarray(aux["zero_expert_counts"]).sum()) == zero_choices  # every zero choice counted, none dropped
  assert int(np.asarray(aux["expert_counts"]).sum()) + int(aux["tokens_dropped"]) == ids.size - zero_choices
  if collective == "padded":  # dropless: the exact rows of the real choices, and nothing for the zero ones
    np.testing.assert_array_equal(np.asarray(aux["traffic_rows"]), expected_traffic(ids, path, dedup))
  if skew == "all_zero":  # nothing crosses any wire, and the token comes back as itself (weights sum to 1)
    assert zero_choices == ids.size
    assert not np.asarray(aux["traffic_rows"]).any() and not np.asarray(aux["traffic_bytes"]).any()
    np.testing.assert_allclose(np.asarray(y), x, rtol=1e-5, atol=1e-6)
  if skew == "random":
    assert 0 < zero_choices < ids.size  # the case exercises both kinds of expert


def _slot_table() -> np.ndarray:
  """Each device keeps its 2 experts plus a replica of expert 0 or 1."""
  per = E // (N * M)
  return np.array([list(range(h * per, (h + 1) * per)) + [h % 2] for h in range(N * M)], np.int32)


# (fields, moe_apply's extra arguments, capacity dispatch groups): the remedies zero experts compose with.
COMPOSED = {
  "s1-gpu_first-capacity": (dict(esp_schedule="s1", path="gpu_first", capacity_factor=1.0), {}, N * M),
  "baseline": (dict(esp_schedule="baseline"), {}, N),
  "s2-capacity": (dict(esp_schedule="s2", capacity_factor=1.5), {}, N),
  "slot_table": (dict(path="node_first"), {"slot_expert": _slot_table()}, N * M),
  "expert_data_parallel": (dict(expert_data_parallel=True), {}, N * M),
  "node_limited": (dict(routing="node_limited", num_nodes=N, node_top_k=1, path="node_first"), {}, N * M),
  "groups-sigmoid-bias": (
    dict(num_groups=4, topk_groups=2, score="sigmoid", routed_scaling=2.5),
    {"expert_bias": helpers.normal(11, (E + Z,)) * 0.05},
    N * M,
  ),
  "global_batch": (
    dict(balance_loss="global_batch"),
    {"balance_counts": np.round(np.abs(helpers.normal(12, (E + Z,))) * 30)},
    N * M,
  ),
  "comet-bounded": (dict(schedule="comet", num_chunks=2, buffer_factor=2.0, path="gpu_first"), {}, N * M),
  "chunked-shared": (dict(schedule="chunked", num_chunks=2, num_shared_experts=1, shared_gate=True), {}, N * M),
  "fp8-wire": (dict(dispatch_dtype="float8_e4m3fn", path="node_first"), {}, N * M),
}


@pytest.mark.parametrize("name", list(COMPOSED))
@pytest.mark.sampled(1)
def test_zero_experts_compose(name, mesh_2x4):
  """Each remedy with zero experts equals the reference (outputs, losses, counts, gradients); with the FP8 wire the
  zero experts' part is the unquantised token (it never travels)."""
  fields, extra, groups = COMPOSED[name]
  cfg = _config(**fields)
  params, x = _inputs(cfg, "random", seed=31)
  state = {k: v for k, v in extra.items() if k != "slot_expert"}
  reference = helpers.reference_run(cfg, params, x, groups, **state)
  _, aux = helpers.assert_matches_reference(cfg, mesh_2x4, params, x, reference=reference, **extra)
  np.testing.assert_array_equal(np.asarray(aux["zero_expert_counts"]), np.asarray(reference[1]["zero_expert_counts"]))
  assert int(np.asarray(aux["zero_expert_counts"]).sum()) == int((np.asarray(aux["expert_ids"]) >= E).sum()) > 0


def test_sequence_loss_counts_every_scored_expert(mesh_2x4):
  """DeepSeek-V3's sequence-wise loss over the E + Z scored experts, as the reference's."""
  cfg = _config(balance_loss="sequence")
  params, x = _inputs(cfg, "random", seed=41)
  helpers.assert_matches_reference(cfg, mesh_2x4, params, x.reshape(16, 8, D), grads=False)


@pytest.mark.parametrize(
  "fields,match",
  [
    (dict(routing="bilevel", num_nodes=N, path="node_first"), "zero_experts=3.*'bilevel'.*runs on no node"),
    (dict(bias_update_rate=0.001), "bias_update_rate=0.001.*compute budget"),
    (dict(zero_experts=-1), "zero_experts=-1.*an int >= 0"),
    (dict(zero_experts=True), "zero_experts=True.*an int >= 0"),
    (dict(top_k=E + Z + 1), f"top_k={E + Z + 1}.*at most {E + Z}"),
  ],
)
def test_refusals_name_the_field_and_the_reason(fields, match):
  with pytest.raises(ConfigError, match=match):
    _config(**fields)


def test_expert_bias_covers_the_zero_experts(mesh_2x4):
  cfg = _config()
  params, x = _inputs(cfg, "random", seed=51)
  with pytest.raises(ConfigError, match=f"expert_bias has shape \\({E},\\); expected \\[{E + Z}\\]"):
    moe_apply(params, x, cfg, mesh_2x4, expert_bias=np.zeros(E, np.float32))


def test_ragged_lowers_for_cuda_with_zero_experts(monkeypatch):
  """The 'ragged' collective (not runnable on XLA:CPU) lowers for CUDA with zero experts: the same planned path."""
  assert helpers.cuda_ragged_shapes(monkeypatch, collective="ragged", zero_experts=2)
