"""The single-device reference against an independent float64 NumPy loop."""

import numpy as np
import pytest

from moejax.moe.config import MoEConfig
from moejax.moe.reference import moe_reference
from tests.helpers import normal, random_params
from tests.numpy_moe import moe_numpy


@pytest.mark.parametrize(
  "k,cf,groups,act,gated,renorm",
  [
    (1, None, 1, "gelu", False, False),
    (2, 1.0, 4, "silu", True, True),
    (4, 0.5, 2, "relu", False, False),
    (2, 1.5, 8, "gelu", True, False),
  ],
)
@pytest.mark.sampled(1)
def test_reference_matches_numpy(k, cf, groups, act, gated, renorm):
  cfg = MoEConfig(
    num_experts=8, top_k=k, d_model=6, d_ff=10, capacity_factor=cf, activation=act, gated=gated, renormalize=renorm
  )
  seed = k * 100 + groups
  params = random_params(cfg, seed)
  x = normal(seed + 1, (32, 6))
  y, aux = moe_reference(params, x, cfg, dispatch_groups=groups)
  y_np, dropped, counts = moe_numpy(params, x, cfg, dispatch_groups=groups)
  np.testing.assert_allclose(np.asarray(y), y_np, rtol=1e-5, atol=1e-6)
  assert int(aux["tokens_dropped"]) == dropped
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), counts)
  if cf is not None:
    assert dropped > 0  # the case exercises the drop rule


def test_load_balance_loss_formula():
  cfg = MoEConfig(num_experts=4, top_k=2, d_model=5, d_ff=7, load_balance_coef=0.3)
  params = random_params(cfg, 3)
  x = normal(4, (16, 5))
  _, aux = moe_reference(params, x, cfg)
  logits = np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, -1)[:, :2]
  f = np.bincount(top.reshape(-1), minlength=4) / (16 * 2)
  np.testing.assert_allclose(float(aux["load_balance_loss"]), 0.3 * 4 * np.sum(f * probs.mean(0)), rtol=1e-5)
