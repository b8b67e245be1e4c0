"""The composition matrix: every combination of the layer's choices runs and equals the single-device
reference, or is refused before compiling with the design reason.

Axes: routing x path x collective x schedule x expert sharding x replicated experts x receive buffers x expert
backend x router options (softmax; DeepSeek-V3's sigmoid, group limit and balancing bias; shared experts;
the sequence-wise loss; the global batch's; Llama 4's weights on the experts' inputs) x deduplicated dispatch x the
dispatch's wire dtype x expert data parallelism: 82,944
combinations. CI runs a covering set: every pair of values of any two axes meets in at
least one case (greedy all-pairs), and every refused pair is checked for its reason.
"""

import itertools
import zlib

import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.validation import ConfigError
from tests import helpers

AXES = {
  "routing": ("topk", "bilevel", "node_limited"),
  "path": ("flat", "gpu_first", "node_first"),
  "collective": ("padded", "capacity"),
  "schedule": ("sequential", "chunked", "comet"),
  "esp_schedule": (None, "baseline", "s1", "s2"),
  "replicas": (False, True),
  "buffer_factor": (None, 2.0),
  "expert_backend": ("dense", "ragged_dot"),
  "router": ("softmax", "deepseek", "sqrtsoftplus", "shared", "sequence_loss", "global_batch", "input_weights"),
  "dedup": (False, True),
  "dispatch_dtype": (None, "float8_e4m3fn"),
  "expert_data_parallel": (False, True),
}
N, M, E, TOKENS = 2, 4, 8, 64


def refusal(case: dict) -> str | None:
  """The design reason a combination is refused for (a regex of the ConfigError), else None."""
  if case["router"] == "input_weights" and case["schedule"] == "comet":
    return "schedule='comet'.*weight_inputs.*before their weights are gathered"
  if case["esp_schedule"] == "baseline" and case["path"] != "flat":
    return "path=.*'flat' with esp_schedule='baseline'.*no intra-node hop"
  if case["routing"] == "bilevel" and case["router"] in ("deepseek", "sqrtsoftplus"):
    return "score='(sigmoid|sqrtsoftplus)'.*routing='bilevel'"
  if case["routing"] == "bilevel" and case["router"] == "sequence_loss":
    return "balance_loss.*routing='bilevel'"
  if case["dedup"] and case["esp_schedule"] == "s2":
    return "dedup=True.*esp_schedule='s2'.*one row per token-choice"
  if case["expert_data_parallel"] and (
    case["esp_schedule"] is not None or case["routing"] != "topk" or case["path"] != "flat"
  ):
    return "expert_data_parallel=True.*every node holds every expert"
  return None


def covering_cases() -> list[dict]:
  """Greedy all-pairs over the runnable combinations, then, for each pair no runnable case holds (a refused
  pair), the first refused combination that holds it."""
  names = list(AXES)
  combos = [dict(zip(names, values)) for values in itertools.product(*AXES.values())]
  bit = {}  # each pair of values of two axes, one bit: a case's pairs are one int, so the greedy search is fast
  pairs = lambda c: sum(1 << bit.setdefault((a, c[a], b, c[b]), len(bit)) for a, b in itertools.combinations(names, 2))
  masks = [pairs(c) for c in combos]
  runnable = [i for i, c in enumerate(combos) if refusal(c) is None]
  uncovered = 0
  for i in runnable:
    uncovered |= masks[i]
  cases = []
  while uncovered:
    best = max(runnable, key=lambda i: (masks[i] & uncovered).bit_count())
    cases.append(best)
    uncovered &= ~masks[best]
  covered = 0
  for i in cases:
    covered |= masks[i]
  for i, c in enumerate(combos):
    if refusal(c) is not None and masks[i] & ~covered:
      cases.append(i)
      covered |= masks[i]
  return [combos[i] for i in cases]


def case_id(case: dict) -> str:
  names = {"replicas": ("one", "replicas"), "dedup": ("perchoice", "dedup"), "expert_data_parallel": ("ep", "edp")}
  return "-".join(names[k][v] if k in names else str(v) for k, v in case.items())


def router_fields(case: dict) -> dict:
  """deepseek: sigmoid scores, routed scaling, group-limited (topk: 4 groups, 2 kept) with a balancing
  bias; sqrtsoftplus: DeepSeek-V4's scores, renormalised and scaled; shared: a gated shared expert; sequence_loss:
  DeepSeek-V3's sequence-wise balance loss; global_batch: f over the step's micro-batches (earlier counts from `layer_state`); input_weights: Llama 4's, the weights (sigmoid
  scores but with 'bilevel') scaling the experts' inputs, and a shared expert."""
  if case["router"] == "deepseek":
    groups = dict(num_groups=4, topk_groups=2) if case["routing"] == "topk" else {}
    return dict(score="sigmoid", renormalize=True, routed_scaling=2.5, bias_update_rate=1e-3, **groups)
  return {
    "softmax": {},
    "sqrtsoftplus": dict(score="sqrtsoftplus", renormalize=True, routed_scaling=1.5),
    "shared": dict(num_shared_experts=1, shared_d_ff=4, shared_gate=True),
    "sequence_loss": dict(balance_loss="sequence"),
    "global_batch": dict(balance_loss="global_batch"),
    "input_weights": dict(
      weight_inputs=True,
      num_shared_experts=1,
      shared_d_ff=4,
      **({} if case["routing"] == "bilevel" else {"score": "sigmoid"}),
    ),
  }[case["router"]]


def config(case: dict) -> MoEConfig:
  capacity = 1.0 if case["collective"] == "capacity" else None
  return MoEConfig(
    num_experts=E,
    top_k=2,
    d_model=8,
    d_ff=8,
    routing=case["routing"],
    num_nodes=N,
    path=case["path"],
    collective=case["collective"],
    capacity_factor=capacity,
    buffer_factor=case["buffer_factor"],
    schedule=case["schedule"],
    num_chunks=2,
    esp_schedule=case["esp_schedule"],
    expert_backend=case["expert_backend"],
    activation="silu",
    gated=True,
    z_loss_coef=1e-3,
    dedup=case["dedup"],
    dispatch_dtype=case["dispatch_dtype"],
    expert_data_parallel=case["expert_data_parallel"],
    **router_fields(case),
  )


def layer_state(case: dict, cfg: MoEConfig) -> dict:
  """moe_apply's state arguments: a balancing bias (deepseek), earlier micro-batches' counts (global_batch)."""
  if case["router"] == "deepseek":
    return {"expert_bias": helpers.normal(11, (E,)) * 0.05}
  if case["router"] == "global_batch":
    return {"balance_counts": np.round(np.abs(helpers.normal(12, (cfg.balance_counts_size,))) * 30)}
  return {}


def slot_table(case: dict) -> np.ndarray | None:
  """Each holder (device, or node with expert sharding) keeps its experts plus a replica of expert 0 or 1."""
  if not case["replicas"]:
    return None
  holders = M if case["expert_data_parallel"] else N if case["esp_schedule"] is not None else N * M
  per = E // holders
  return np.array([list(range(h * per, (h + 1) * per)) + [h % 2] for h in range(holders)], np.int32)


CASES = covering_cases()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_combination_equals_reference_or_is_refused(case, mesh_2x4):
  reason = refusal(case)
  if reason is not None:
    with pytest.raises(ConfigError, match=reason):
      cfg = config(case)
      moe_apply(
        helpers.random_params(cfg, 0),
        helpers.normal(1, (TOKENS // 8, 8, 8)),
        cfg,
        mesh_2x4,
        slot_expert=slot_table(case),
      )
    return
  cfg = config(case)
  seed = zlib.crc32(case_id(case).encode()) % 1000
  params, x = helpers.random_params(cfg, seed), helpers.normal(seed + 7, (TOKENS // 8, 8, 8))  # sequences of 8
  groups = N if case["esp_schedule"] in ("baseline", "s2") else N * M
  _, aux = helpers.assert_matches_reference(
    cfg, mesh_2x4, params, x, dispatch_groups=groups, slot_expert=slot_table(case), **layer_state(case, cfg)
  )
  if cfg.capacity_factor is not None:
    assert int(aux["tokens_dropped"]) > 0  # capacity 1.0 on random routing drops some choices


def test_every_pair_of_choices_is_covered():
  """The covering set meets every pair of values of any two axes (the property the matrix relies on)."""
  names = list(AXES)
  seen = {(a, c[a], b, c[b]) for c in CASES for a, b in itertools.combinations(names, 2)}
  for a, b in itertools.combinations(names, 2):
    for va, vb in itertools.product(AXES[a], AXES[b]):
      assert (a, va, b, vb) in seen, (a, va, b, vb)


@pytest.mark.slow
@pytest.mark.parametrize(
  "esp_schedule,path", [(None, "flat"), (None, "node_first"), ("s1", "gpu_first"), ("s2", "flat"), ("baseline", "flat")]
)
def test_schedules_drop_what_sequential_drops(esp_schedule, path, mesh_2x4):
  """Every token's choices forced to experts 5 and 6 with receive buffers of half the rows sent: every
  schedule overflows the same choices as 'sequential' and gives the same outputs and counts."""
  results = {}
  for schedule in AXES["schedule"]:
    cfg = MoEConfig(
      num_experts=E,
      top_k=2,
      d_model=8,
      d_ff=8,
      path=path,
      buffer_factor=0.5,
      schedule=schedule,
      num_chunks=2,
      esp_schedule=esp_schedule,
    )
    params, x = helpers.force_routing(helpers.random_params(cfg, 3), helpers.normal(4, (TOKENS, 8)), [5, 6])
    results[schedule] = moe_apply(params, x, cfg, mesh_2x4)
  y_seq, aux_seq = results["sequential"]
  assert int(aux_seq["tokens_overflowed"]) > 0
  for schedule, (y, aux) in results.items():
    assert helpers.relative_error(y, y_seq) < 1e-6, schedule
    for name in ("expert_counts", "tokens_overflowed", "tokens_dropped"):
      np.testing.assert_array_equal(np.asarray(aux[name]), np.asarray(aux_seq[name]), err_msg=schedule)
