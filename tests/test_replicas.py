"""The layer on a slot table (replicated experts): each row goes to one replica, rows split evenly,
and outputs, losses and gradients equal the reference's for the logical experts."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import replicas
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.replication.rebalance import rebalance
from moejax.validation import ConfigError
from tests.helpers import assert_matches_reference, force_routing, normal, random_params


def _slots_loop(ids, slot_expert_flat, me):
  """NumPy: the j-th row of expert e (in row order) goes to replica (j + me) mod c_e, replicas in slot order."""
  seen, out = {}, []
  for e in ids:
    if e < 0:
      out.append(-1)
      continue
    slots = np.flatnonzero(slot_expert_flat == e)
    j = seen.get(e, 0)
    seen[e] = j + 1
    out.append(slots[(j + me) % len(slots)])
  return np.array(out)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.sampled(1)
def test_rows_go_to_replicas_in_turn(seed):
  rng = np.random.default_rng(seed)
  experts, slots = 6, 16
  table = np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)])
  rng.shuffle(table)
  ids = rng.integers(-1, experts, 200)
  ids[:50] = 2  # a popular expert
  for me in (0, 3):
    got = replicas.to_slots(jnp.asarray(ids), jnp.asarray(table), experts, me)
    np.testing.assert_array_equal(got, _slots_loop(ids, table, me))
    np.testing.assert_array_equal(replicas.to_experts(got, jnp.asarray(table)), ids)


@pytest.mark.parametrize("path,schedule", [("flat", "sequential"), ("gpu_first", "comet")])
@pytest.mark.sampled(1)
def test_replicated_layer_matches_reference(mesh_2x4, path, schedule):
  """8 logical experts in 16 slots planned by `rebalance` for Zipf loads: replicas are copies, so the
  layer is the reference's; gradients of the copies sum onto the logical weights."""
  cfg = MoEConfig(
    num_experts=8, top_k=2, d_model=8, d_ff=12, path=path, schedule=schedule, num_chunks=2, gated=True, renormalize=True
  )
  table = rebalance(1.0 / np.arange(1, 9) ** 1.2, 2, 4, 2)
  assert len(np.unique(table)) == 8 and np.bincount(table.ravel()).max() > 1  # some expert is replicated
  params = random_params(cfg, 3)
  x = normal(4, (64, 8))
  assert_matches_reference(cfg, mesh_2x4, params, x, slot_expert=jnp.asarray(table))


@pytest.mark.slow
def test_a_hot_expert_is_split_evenly_over_its_replicas(mesh_2x4):
  """Every first choice to expert 0, held by 4 slots on 4 devices: each of those devices receives
  its share of the rows within one row per source."""
  cfg = MoEConfig(num_experts=8, top_k=1, d_model=8, d_ff=12)
  params, x = force_routing(random_params(cfg, 21), normal(22, (8 * 16, 8)), [0])
  table = np.array([[0, 1], [0, 2], [0, 3], [0, 4], [5, 6], [7, 1], [2, 3], [4, 5]])
  y, aux = moe_apply(params, x, cfg, mesh_2x4, slot_expert=jnp.asarray(table))
  y_plain, _ = moe_apply(params, x, cfg, mesh_2x4)
  np.testing.assert_allclose(y, y_plain, rtol=1e-5, atol=1e-6)
  received = np.asarray(aux["traffic_rows"])[0].sum(0)
  assert int(aux["expert_counts"][0]) == 128 == received[:4].sum()
  assert received[:4].max() - received[:4].min() <= 8 and received[4:].sum() == 0


def test_bad_slot_tables_are_named(mesh_2x4):
  cfg = MoEConfig(num_experts=8, top_k=1, d_model=8, d_ff=12)
  params = random_params(cfg, 0)
  x = jnp.ones((64, 8))
  with pytest.raises(ConfigError, match=r"experts \[7\] have no slot"):
    moe_apply(params, x, cfg, mesh_2x4, slot_expert=jnp.arange(16).reshape(8, 2) % 7)
  with pytest.raises(ConfigError, match=r"slot_expert has shape \(4, 2\)"):
    moe_apply(params, x, cfg, mesh_2x4, slot_expert=jnp.zeros((4, 2), jnp.int32))
  with pytest.raises(ConfigError, match="outside"):
    moe_apply(params, x, cfg, mesh_2x4, slot_expert=jnp.arange(16).reshape(8, 2))
  sharded = MoEConfig(num_experts=8, top_k=1, d_model=8, d_ff=12, esp_schedule="s1")
  with pytest.raises(ConfigError, match=r"slot_expert has shape \(8, 2\); expected \[2 nodes"):
    moe_apply(params, x, sharded, mesh_2x4, slot_expert=jnp.arange(16).reshape(8, 2) % 8)  # a row per node
