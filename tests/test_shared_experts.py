"""Shared experts (DeepSeek-V2/V3, Qwen2-MoE): dense FFNs on every token beside the routed experts."""

import re

import jax
import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import param_specs
from tests import helpers
from tests.helpers import normal, random_params
from tests.hlo_graph import contains, entry_graph, float_exchanges


@pytest.mark.slow
def test_shared_ffn_does_not_wait_for_the_dispatch(mesh_2x4):
  """In the compiled program no float exchange (the padded ring's loop of collective permutes: the
  dispatch or the combine) is an ancestor of a shared-expert matmul (width 24 marks them), so the scheduler may
  run the shared FFN while the dispatch is in flight."""
  cfg = MoEConfig(num_experts=16, top_k=2, d_model=8, d_ff=12, num_shared_experts=2, shared_d_ff=12)
  params = random_params(cfg, 0)
  x = normal(1, (mesh_2x4.size * 8, 8))
  hlo = jax.jit(lambda p, x: moe_apply(p, x, cfg, mesh_2x4)).lower(params, x).compile().as_text()
  nodes, ancestors, bodies = entry_graph(hlo)
  is_dot = lambda name: nodes[name][0] == "dot" or any(contains(bodies, c, "dot") for c in nodes[name][3])
  shared = [n for n in nodes if is_dot(n) and re.search(r"f32\[\d+,24\]", nodes[n][1])]
  exchanges = float_exchanges(nodes, bodies)
  assert shared and exchanges
  for name in shared:
    assert not set(exchanges) & ancestors[name], name


def test_shared_experts_are_sharded_like_the_dense_ffn():
  """Replicated with expert parallelism; with expert sharding (tensor parallelism's setting) split over
  'gpu' on their hidden width, like the model's dense FFN."""
  ep = param_specs(MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=8, num_shared_experts=1, gated=True))
  assert all(spec == jax.sharding.PartitionSpec() for spec in ep["shared"].values())
  esp = param_specs(
    MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=8, num_shared_experts=1, gated=True, esp_schedule="s2")
  )
  assert esp["shared"]["w_in"] == esp["shared"]["w_gate"] == jax.sharding.PartitionSpec(None, "gpu")
  assert esp["shared"]["w_out"] == jax.sharding.PartitionSpec("gpu", None)


def test_shared_output_is_added_to_every_token(mesh_2x4):
  """Routing every token to expert 3 with capacity 1 per expert drops most routed choices; each token
  still gets the shared experts' output (float64 NumPy), gated by sigmoid(x w_g)."""
  cfg = MoEConfig(
    num_experts=8,
    top_k=1,
    d_model=8,
    d_ff=8,
    collective="capacity",
    capacity_factor=0.1,
    num_shared_experts=2,
    shared_d_ff=4,
    shared_gate=True,
    activation="relu",
  )
  params, x = helpers.force_routing(helpers.random_params(cfg, 5), helpers.normal(6, (64, 8)), [3])
  y, aux = moe_apply(params, x, cfg, mesh_2x4)
  dropped = np.ones(64, bool)
  dropped[np.arange(8) * 8] = False  # each device's first token keeps its one capacity slot
  assert int(aux["tokens_dropped"]) == 56
  s = {k: np.asarray(v, np.float64) for k, v in params["shared"].items()}
  x64 = np.asarray(x, np.float64)
  gate = 1 / (1 + np.exp(-(x64 @ np.asarray(params["shared_gate"]["kernel"], np.float64))))
  want = gate * (np.maximum(x64 @ s["w_in"], 0) @ s["w_out"])
  np.testing.assert_allclose(np.asarray(y)[dropped], want[dropped], rtol=1e-5, atol=1e-6)
