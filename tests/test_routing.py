"""Routing against plain Python loops and float64 NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import routing
from moejax.moe.config import MoEConfig


@pytest.mark.parametrize("num_experts,tokens,k", [(8, 64, 2), (256, 128, 8), (4, 33, 3), (1, 5, 1)])
@pytest.mark.sampled(1)
def test_queue_positions_follow_gshard_priority(num_experts, tokens, k):
  """Every first choice before any second choice, earlier tokens first within a rank (a loop over
  choices and tokens), on random and on all-to-one-expert routing."""
  rng = np.random.default_rng(num_experts + tokens)
  for ids in (rng.integers(0, num_experts, (tokens, k)), np.full((tokens, k), num_experts - 1)):
    want, seen = np.zeros_like(ids), {}
    for c in range(k):
      for t in range(tokens):
        want[t, c] = seen.get(ids[t, c], 0)
        seen[ids[t, c]] = want[t, c] + 1
    got = np.asarray(routing.queue_positions(jnp.asarray(ids, jnp.int32), num_experts))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
  "group_score,score,renormalize",
  [
    ("max", "softmax", False),
    ("top2_sum", "sigmoid", True),
    ("top2_sum", "sigmoid", False),
    ("top2_sum", "sqrtsoftplus", True),
  ],
)
@pytest.mark.sampled(1)
def test_group_limited_routing_matches_numpy(group_score, score, renormalize):
  """DeepSeek-V2's group_limited_greedy (groups ranked by their best score, softmax weights scaled, not
  renormalised) and V3's (by their two best, sigmoid, with and without norm_topk_prob), and V3's with DeepSeek-V4's
  sqrt(softplus) scores, against float64 NumPy."""
  e, groups, kept, k, scale = 16, 4, 2, 3, 2.5
  cfg = MoEConfig(
    num_experts=e,
    top_k=k,
    d_model=8,
    d_ff=4,
    score=score,
    num_groups=groups,
    topk_groups=kept,
    group_score=group_score,
    routed_scaling=scale,
    renormalize=renormalize,
  )
  rng = np.random.default_rng(7)
  x, kernel = rng.normal(size=(64, 8)), rng.normal(size=(8, e))
  decision, _ = routing.route(
    jnp.asarray(x, jnp.float32), {"router": {"kernel": jnp.asarray(kernel, jnp.float32)}}, cfg
  )
  logits = x @ kernel
  scores = {
    "softmax": np.exp(logits) / np.exp(logits).sum(-1, keepdims=True),
    "sigmoid": 1 / (1 + np.exp(-logits)),
    "sqrtsoftplus": np.sqrt(np.log1p(np.exp(logits))),
  }[score]
  per_group = np.sort(scores.reshape(64, groups, -1), axis=-1)[..., ::-1]
  group_scores = per_group[..., 0] if group_score == "max" else per_group[..., :2].sum(-1)
  for t in range(64):
    allowed = np.argsort(-group_scores[t])[:kept]
    candidates = [i for i in range(e) if i // (e // groups) in allowed]
    want = sorted(candidates, key=lambda i: -scores[t, i])[:k]
    w = scores[t, want]
    w = (w / w.sum() if renormalize else w) * scale
    order = np.argsort(np.asarray(decision.expert_ids[t]))
    np.testing.assert_array_equal(np.asarray(decision.expert_ids[t])[order], np.sort(want))
    np.testing.assert_allclose(np.asarray(decision.weights[t])[order], w[np.argsort(want)], rtol=1e-5)
