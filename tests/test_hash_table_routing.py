"""Table hash routing (`routing='hash'` with `hash_vocab` = V, DeepSeek-V4's tid2eid): each token id's experts are a
row of a frozen table [V, K] of the layer. On the simulated 2 x 4 mesh the layer with a fresh random table, and with
a skewed one (every id to the same two experts), equals the single-device reference and a float64 NumPy layer written
here; placed, it equals the unplaced layer; the default table is the hash function's routing; bad tables, ids outside
[0, V) and a table without hash routing are refused naming the value (traced ids: clipped and counted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.module import MoELayer
from moejax.moe.reference import moe_reference
from moejax.moe.routing.hashed import hash_experts
from moejax.placement.apply import apply_placement, expert_order, permute_expert_state
from moejax.validation import ConfigError
from tests import helpers

E, K, TOKENS, D, F, VOCAB, LIMIT = 16, 2, 64, 8, 12, 1000, 1.5


def _config(**fields) -> MoEConfig:
  base = dict(
    num_experts=E,
    top_k=K,
    d_model=D,
    d_ff=F,
    routing="hash",
    hash_vocab=VOCAB,
    score="sigmoid",
    renormalize=True,
    routed_scaling=2.5,
    gated=True,
    activation="swiglu_clamped_v4",
    swiglu_limit=LIMIT,
    num_shared_experts=1,
  )
  return MoEConfig(**(base | fields))


def _random_table(seed: int, scored: int = E) -> np.ndarray:
  """[V, K] int32: K distinct experts per id, drawn afresh (never the hash's, never zeros)."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.choice(scored, K, replace=False) for _ in range(VOCAB)]).astype(np.int32)


def _numpy_layer(params, x, ids, table, cfg) -> np.ndarray:
  """float64 NumPy, from DeepSeek-V4's definitions: experts table[id], weights sigmoid(x Wr) at them renormalised
  times routed_scaling; each expert (and the shared one) down(silu(min(x Wg, L)) * clip(x Wi, -L, L))."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  silu = lambda a: a / (1 + np.exp(-a))
  ffn = lambda x, wg, wi, wo: (silu(np.minimum(x @ wg, LIMIT)) * np.clip(x @ wi, -LIMIT, LIMIT)) @ wo
  scores = 1 / (1 + np.exp(-(x @ p["router"]["kernel"])))
  experts = table[ids]
  w = np.take_along_axis(scores, experts, 1)
  w = w / w.sum(1, keepdims=True) * cfg.routed_scaling
  shared = p["shared"]
  y = ffn(x, shared["w_gate"], shared["w_in"], shared["w_out"])
  for t in range(len(x)):
    for c in range(K):
      e = experts[t, c]
      y[t] += w[t, c] * ffn(x[t], p["w_gate"][e], p["w_in"][e], p["w_out"][e])
  return y


def _inputs(seed: int, cfg):
  """Parameters with pre-activations scaled so the clamps act, x [T, d] and fresh random ids [T] in [0, V)."""
  params = helpers.random_params(cfg, seed)
  params = {k: (3 * v if k in ("w_in", "w_gate") else v) for k, v in params.items()}
  ids = np.random.default_rng(seed + 1).integers(0, VOCAB, TOKENS)
  return params, helpers.normal(seed + 2, (TOKENS, D)), ids


@pytest.mark.parametrize("skew", [False, True], ids=["random-table", "one-row-for-all"])
@pytest.mark.sampled(1)
def test_layer_with_a_table_equals_the_reference_and_float64_numpy(skew, mesh_2x4):
  cfg = _config(path="node_first")
  params, x, ids = _inputs(3, cfg)
  table = np.tile(np.int32([5, 11]), (VOCAB, 1)) if skew else _random_table(4)
  reference = helpers.run_with_grads(lambda p, v: moe_reference(p, v, cfg, token_ids=ids, hash_table=table), params, x)
  y, aux = helpers.assert_matches_reference(
    cfg, mesh_2x4, params, x, reference=reference, token_ids=ids, hash_table=table
  )
  np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), table[ids])
  assert helpers.relative_error(np.asarray(y), _numpy_layer(params, x, ids, table, cfg)) < 1e-5
  assert int(aux["hash_ids_clipped"]) == 0
  if skew:
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(aux["expert_counts"])), [5, 11])


def test_a_placed_layer_with_a_table_equals_the_unplaced_one(mesh_2x4):
  """Experts and router columns moved by a random placement, `hash_index` moved with them, the table unchanged (in
  the experts' original numbering): the same outputs and losses, each choice at its expert's new index."""
  cfg = _config(zero_experts=2)
  params, x, ids = _inputs(5, cfg)
  table = _random_table(6, E + 2)
  placement = np.random.default_rng(7).permutation(np.repeat(np.arange(8), E // 8))[None]
  order = expert_order(placement)
  placed = apply_placement([params], placement, cfg)[0]
  state = permute_expert_state([{"hash_index": np.arange(E + 2), "hash_table": table}], order, cfg)[0]
  assert state["hash_table"] is table
  y, aux = moe_apply(params, x, cfg, mesh_2x4, token_ids=ids, hash_table=table)
  y_placed, aux_placed = moe_apply(placed, x, cfg, mesh_2x4, token_ids=ids, **state)
  assert helpers.relative_error(np.asarray(y_placed), np.asarray(y)) < 1e-6
  np.testing.assert_allclose(float(aux_placed["aux_loss"]), float(aux["aux_loss"]), rtol=1e-6)
  old_of = np.concatenate([order[0], np.arange(E, E + 2)])  # index -> the expert now there
  np.testing.assert_array_equal(old_of[np.asarray(aux_placed["expert_ids"])], table[ids])


def test_the_default_table_routes_as_the_hash_function(mesh_2x4):
  cfg = _config(activation="silu")
  layer = MoELayer(cfg, mesh_2x4, rngs=nnx.Rngs(0))
  table = np.asarray(layer.hash_table[...])
  assert table.shape == (VOCAB, K) and table.dtype == np.int32
  np.testing.assert_array_equal(table, np.asarray(hash_experts(jnp.arange(VOCAB), K, E)))
  _, x, ids = _inputs(8, cfg)
  y_table, aux = layer(jnp.asarray(x), token_ids=ids)  # the module passes its own table
  y_hash, _ = moe_apply(layer.params(), x, _config(activation="silu", hash_vocab=0), mesh_2x4, token_ids=ids)
  np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), np.asarray(hash_experts(jnp.asarray(ids), K, E)))
  np.testing.assert_array_equal(np.asarray(y_table), np.asarray(y_hash))


def _bad(row: int, values) -> np.ndarray:
  table = _random_table(9)
  table[row] = values
  return table


@pytest.mark.parametrize(
  "fields,table,match",
  [
    ({}, _bad(7, [3, E]), r"hash_table\[7, 1\]=16 .*an expert in \[0, 16\)"),
    ({}, _bad(2, [-1, 4]), r"hash_table\[2, 0\]=-1 .*an expert in \[0, 16\)"),
    ({}, _bad(5, [9, 9]), r"hash_table\[5\]=\[9, 9\] .*2 distinct experts"),
    ({}, _random_table(9)[:-1], r"hash_table=\(\(999, 2\), 'int32'\).*\[1000, 2\]"),
    ({}, _random_table(9).astype(np.float32), r"hash_table=.*'float32'\).*integer experts"),
    ({"hash_vocab": 0}, _random_table(9), r"hash_table='given'.*None unless hash_vocab > 0"),
    ({"routing": "topk", "hash_vocab": 0}, _random_table(9), r"hash_table='given'.*None unless hash_vocab > 0"),
  ],
  ids=["past-E", "negative", "repeated", "short", "float", "no-vocab", "topk"],
)
def test_bad_tables_are_refused_naming_the_value(fields, table, match, mesh_2x4):
  cfg = _config(**fields)
  params, x, ids = _inputs(0, cfg)
  with pytest.raises(ConfigError, match=match):
    moe_apply(params, x, cfg, mesh_2x4, token_ids=ids if cfg.routing == "hash" else None, hash_table=table)


@pytest.mark.parametrize(
  "fields,match",
  [
    (dict(routing="topk"), r"hash_vocab=1000 .*0 unless routing='hash'"),
    (dict(hash_vocab=-3), r"hash_vocab=-3 .*an int >= 0"),
    (dict(hash_vocab=True), r"hash_vocab=True .*an int >= 0"),
  ],
)
def test_config_refusals(fields, match):
  with pytest.raises(ConfigError, match=match):
    _config(**fields)


def test_ids_outside_the_table_refused_when_concrete_clipped_and_counted_when_traced(mesh_2x4):
  cfg = _config()
  params, x, ids = _inputs(10, cfg)
  table = _random_table(11)
  ids[[3, 40]] = VOCAB, -2
  with pytest.raises(ConfigError, match=r"token_ids=\[1000\] .*ids in \[0, hash_vocab=1000\)"):
    moe_apply(params, x, cfg, mesh_2x4, token_ids=ids, hash_table=table)
  run = jax.jit(lambda i: moe_apply(params, x, cfg, mesh_2x4, token_ids=i, hash_table=table))
  y, aux = run(jnp.asarray(ids))
  assert int(aux["hash_ids_clipped"]) == 2
  clipped = np.clip(ids, 0, VOCAB - 1)
  np.testing.assert_array_equal(np.asarray(aux["expert_ids"]), table[clipped])
  y_clipped, _ = moe_apply(params, x, cfg, mesh_2x4, token_ids=clipped, hash_table=table)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_clipped))
