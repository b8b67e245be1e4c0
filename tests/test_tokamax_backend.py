"""expert_backend='tokamax' (tokamax.ragged_dot) against 'ragged_dot': same outputs and gradients."""

import sys

import jax
import jax.numpy as jnp
import pytest

from moejax.moe import experts
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.validation import ConfigError
from tests.helpers import normal, random_params


@pytest.mark.parametrize(
  "path,collective,gated", [("flat", "padded", True), ("gpu_first", "padded", False), ("flat", "capacity", True)]
)
def test_tokamax_matches_ragged_dot(mesh_2x4, path, collective, gated):
  pytest.importorskip("tokamax")
  extra = {"capacity_factor": 1.0} if collective == "capacity" else {}
  cfgs = [
    MoEConfig(
      num_experts=8,
      top_k=2,
      d_model=16,
      d_ff=32,
      path=path,
      collective=collective,
      gated=gated,
      expert_backend=b,
      **extra,
    )
    for b in ("ragged_dot", "tokamax")
  ]
  params = random_params(cfgs[0], 0)
  x = normal(1, (64, 16))

  def loss(p, v, cfg):
    y, aux = moe_apply(p, v, cfg, mesh_2x4)
    return jnp.sum(y * y) + aux["aux_loss"], y

  (l0, y0), g0 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cfgs[0])
  (l1, y1), g1 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cfgs[1])
  assert jnp.max(jnp.abs(y0 - y1)) < 1e-5
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert jnp.max(jnp.abs(a - b)) < 1e-4


def test_rows_past_the_groups_are_zero():
  pytest.importorskip("tokamax")
  x, w = jnp.ones((10, 4)), jnp.ones((3, 4, 5))
  y = experts.grouped_matmul(x, w, jnp.array([2, 0, 3], jnp.int32), "tokamax")
  assert y.dtype == jnp.float32 and float(jnp.abs(y[5:]).max()) == 0.0 and float(y[:5].min()) == 4.0


def test_missing_tokamax_names_the_fix(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
  with pytest.raises(ImportError, match=r"moejax\[tokamax\]"):
    experts.grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.array([2], jnp.int32), "tokamax")
  monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "tokamax" else object())
  with pytest.raises(ConfigError, match=r"expert_backend.*moejax\[tokamax\]"):
    MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, expert_backend="tokamax")
