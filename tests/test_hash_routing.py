"""Hash routing (`routing='hash'`, DeepSeek-V4's hash-routed layers): the experts are a fixed function of the token id,
known before the layer runs; the layer equals the single-device reference on every path, with fresh random ids and
with every token given one id (all rows to the same experts); placed (experts moved to other devices), each id still
reaches its experts where they now sit; what it refuses and why."""

import numpy as np
import pytest

from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.reference import moe_reference
from moejax.moe.routing.hashed import MULTIPLIER, hash_experts
from moejax.placement.apply import apply_placement, expert_order, permute_expert_state
from moejax.validation import ConfigError
from tests import helpers

E, TOKENS, D, VOCAB = 16, 128, 8, 50_000


def _config(**fields) -> MoEConfig:
  base = dict(num_experts=E, top_k=2, d_model=D, d_ff=12, routing="hash", renormalize=True, z_loss_coef=1e-3)
  return MoEConfig(**(base | fields))


def _plain_hash(token_id: int, k: int, scored: int) -> list[int]:
  """The hash in Python integers: h = (id * MULTIPLIER mod 2^32) mod W, then k experts W // k apart."""
  h = token_id * MULTIPLIER % 2**32 % scored
  return [(h + j * (scored // k)) % scored for j in range(k)]


@pytest.mark.parametrize("k,scored", [(1, 16), (2, 19), (4, 32), (3, 8)])
def test_hash_is_the_plain_formula_with_distinct_experts(k, scored):
  ids = np.random.default_rng(k).integers(0, 2**31 - 1, 300)
  got = np.asarray(hash_experts(ids, k, scored))
  np.testing.assert_array_equal(got, [_plain_hash(int(i), k, scored) for i in ids])
  assert all(len(set(row)) == k for row in got.tolist())


def _ids(seed: int, skew: bool, shape=(TOKENS,)) -> np.ndarray:
  """Fresh random token ids, or one id for every token (every row to the same k experts)."""
  return np.full(shape, 4242) if skew else np.random.default_rng(seed).integers(0, VOCAB, shape)


CASES = [
  pytest.param(path, dedup, skew, id=f"{path}-dedup{dedup}-{'skew' if skew else 'random'}")
  for path in path_lib.PATHS
  for dedup in (True, False)
  for skew in (False, True)
]


@pytest.mark.parametrize("path,dedup,skew", CASES)
@pytest.mark.sampled(2)
def test_layer_equals_reference_with_the_plan_known_before(path, dedup, skew, mesh_2x4):
  cfg = _config(path=path, dedup=dedup)
  params, x = helpers.random_params(cfg, 3), helpers.normal(4, (TOKENS, D))
  ids = _ids(5, skew)
  reference = helpers.run_with_grads(lambda p, v: moe_reference(p, v, cfg, token_ids=ids), params, x)
  _, aux = helpers.assert_matches_reference(cfg, mesh_2x4, params, x, reference=reference, token_ids=ids)
  np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), np.asarray(hash_experts(ids, 2, E)))


# (fields, capacity dispatch groups): hash routing with the other remedies.
COMPOSED = {
  "s1-capacity": (dict(esp_schedule="s1", path="gpu_first", capacity_factor=1.0), 8),
  "s2": (dict(esp_schedule="s2", capacity_factor=1.5), 2),
  "zero-experts-sigmoid": (dict(zero_experts=3, score="sigmoid", routed_scaling=2.5, path="node_first"), 8),
  "comet-sequence-loss": (dict(schedule="comet", num_chunks=2, balance_loss="sequence"), 8),
}


@pytest.mark.parametrize("name", list(COMPOSED))
@pytest.mark.sampled(1)
def test_hash_routing_composes(name, mesh_2x4):
  fields, groups = COMPOSED[name]
  cfg = _config(**fields)
  params, x = helpers.random_params(cfg, 6), helpers.normal(7, (16, 8, D))  # sequences of 8
  ids = _ids(8, False, (16, 8))
  apply = lambda p, v: moe_reference(p, v, cfg, dispatch_groups=groups, token_ids=ids)
  reference = helpers.run_with_grads(apply, params, x)
  helpers.assert_matches_reference(cfg, mesh_2x4, params, x, reference=reference, token_ids=ids)


@pytest.mark.parametrize("zeros,skew", [(0, False), (3, True)], ids=["random", "zero-experts-one_id"])
def test_a_placed_layer_sends_each_id_to_its_experts_where_they_now_sit(zeros, skew, mesh_2x4):
  """A random placement of the 16 experts over the 8 devices moves experts and router columns; the layer's
  `hash_index` (moved by `permute_expert_state`) routes every id to the same experts at their new indices, on the
  devices the placement names, with the unplaced layer's outputs and losses. Without it the outputs change."""
  cfg = _config(zero_experts=zeros, path="node_first")
  params, x, ids = helpers.random_params(cfg, 3), helpers.normal(4, (TOKENS, D)), _ids(5, skew)
  placement = np.random.default_rng(6).permutation(np.repeat(np.arange(8), E // 8))[None]
  order = expert_order(placement)
  placed = apply_placement([params], placement, cfg)[0]
  index = permute_expert_state([{"hash_index": np.arange(E + zeros)}], order, cfg)[0]["hash_index"]
  y, aux = moe_apply(params, x, cfg, mesh_2x4, token_ids=ids)
  y_placed, aux_placed = moe_apply(placed, x, cfg, mesh_2x4, token_ids=ids, hash_index=index)
  assert helpers.relative_error(np.asarray(y_placed), np.asarray(y)) < 1e-6
  assert abs(float(aux_placed["aux_loss"]) - float(aux["aux_loss"])) < 1e-6 * abs(float(aux["aux_loss"]))
  before, after = np.asarray(aux["expert_ids"]), np.asarray(aux_placed["expert_ids"])
  real = before < E
  old_of = np.concatenate([order[0], np.arange(E, E + zeros)])  # index -> the expert now there
  np.testing.assert_array_equal(old_of[after], before)
  np.testing.assert_array_equal(after[real] // (E // 8), placement[0][before[real]])  # on the named device
  np.testing.assert_array_equal(after[~real], before[~real])  # zero experts sit nowhere: they stay
  y_unindexed, _ = moe_apply(placed, x, cfg, mesh_2x4, token_ids=ids)
  assert helpers.relative_error(np.asarray(y_unindexed), np.asarray(y)) > 1e-2


@pytest.mark.parametrize(
  "routing,hash_index,match",
  [
    ("hash", np.arange(E)[::-1].copy() % 8, "hash_index=.*a permutation of 0 .. 15"),
    ("hash", np.arange(E - 1), "hash_index=.*a permutation of 0 .. 15"),
    ("hash", np.arange(E, dtype=np.float32), "hash_index=.*a permutation of 0 .. 15"),
    ("topk", np.arange(E), "hash_index='given'.*None unless routing='hash'"),
  ],
)
def test_hash_index_is_checked_before_tracing(routing, hash_index, match, mesh_2x4):
  cfg = _config(routing=routing)
  ids = _ids(1, False) if routing == "hash" else None
  with pytest.raises(ConfigError, match=match):
    moe_apply(
      helpers.random_params(cfg, 0), helpers.normal(1, (TOKENS, D)), cfg, mesh_2x4, token_ids=ids, hash_index=hash_index
    )


@pytest.mark.parametrize(
  "fields,match",
  [
    (dict(bias_update_rate=0.001), "bias_update_rate=0.001.*a hash of the token id chooses them"),
    (dict(num_groups=4), "num_groups=4.*None unless routing='topk'"),
  ],
)
def test_config_refusals(fields, match):
  with pytest.raises(ConfigError, match=match):
    _config(**fields)


@pytest.mark.parametrize(
  "routing,token_ids,match",
  [
    ("hash", None, "token_ids=None.*integer ids of shape \\(128,\\)"),
    ("hash", np.zeros(64, np.int32), "token_ids=\\(64,\\).*integer ids of shape \\(128,\\)"),
    ("hash", np.zeros(128, np.float32), "token_ids=\\(128,\\).*integer ids"),
    ("topk", np.zeros(128, np.int32), "token_ids='given'.*None unless routing='hash'"),
  ],
)
def test_token_ids_are_checked_before_tracing(routing, token_ids, match, mesh_2x4):
  cfg = _config(routing=routing)
  with pytest.raises(ConfigError, match=match):
    moe_apply(helpers.random_params(cfg, 0), helpers.normal(1, (TOKENS, D)), cfg, mesh_2x4, token_ids=token_ids)
