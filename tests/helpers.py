"""Shared test helpers: fresh random inputs, and the one comparison with the single-device reference."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe.layer import moe_apply, param_shapes
from moejax.moe.reference import moe_reference


def normal(seed: int, shape) -> np.ndarray:
  """Fresh float32 normal draws from NumPy (no JAX program to compile per shape)."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def random_params(cfg, seed: int) -> dict:
  """Parameters in the public layout, fan-in scaled normal draws."""
  is_shape = lambda s: isinstance(s, tuple)
  shapes = param_shapes(cfg)
  draws = [normal(seed + i, s) / np.sqrt(s[-2]) for i, s in enumerate(jax.tree.leaves(shapes, is_leaf=is_shape))]
  return jax.tree.unflatten(jax.tree.structure(shapes, is_leaf=is_shape), draws)


def force_routing(params, x, experts, strength=30.0):
  """Routes every token's top choices to `experts` (in that order) through a constant input feature
  (flat routers: 'router' [d, E])."""
  x, kernel = np.array(x), np.array(params["router"]["kernel"])
  x[:, 0] = 1.0
  for rank, e in enumerate(experts):
    kernel[0, e] = strength - rank
  return {**params, "router": {"kernel": kernel}}, x


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_with_grads(apply, params, x, grads=True):
  """(y, aux, gradients w.r.t. params and x of sum(y * c) + aux_loss for a fixed random cotangent c,
  or None without grads)."""
  if not grads:
    return *jax.jit(apply)(params, x), None
  cotangent = normal(99, x.shape)

  def loss(p, x):
    y, aux = apply(p, x)
    return jnp.sum(y * cotangent) + aux["aux_loss"], (y, aux)
  (_, (y, aux)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, aux, g


def assert_matches_reference(cfg, mesh, params, x, *, num_groups: int, tol=1e-5, grads=True, **layer_kwargs):
  """The layer (`moe_apply(..., **layer_kwargs)`) equals `moe_reference(num_groups=...)`: y, the losses,
  expert counts, drops, nothing overflowed, and (if `grads`) the gradients w.r.t. x and every parameter."""
  y, aux, g = run_with_grads(lambda p, x: moe_apply(p, x, cfg, mesh, **layer_kwargs), params, x, grads)
  bias = layer_kwargs.get("expert_bias")
  y_ref, aux_ref, g_ref = run_with_grads(
      lambda p, x: moe_reference(p, x, cfg, num_groups=num_groups, expert_bias=bias), params, x, grads)
  assert relative_error(y, y_ref) < tol
  for name in ("load_balance_loss", "z_loss", "aux_loss"):
    np.testing.assert_allclose(float(aux[name]), float(aux_ref[name]), rtol=tol, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(aux_ref["expert_counts"]))
  assert int(aux["tokens_dropped"]) == int(aux_ref["tokens_dropped"])
  assert int(aux["tokens_overflowed"]) == 0
  if grads:
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(g_ref)):
      scale = np.linalg.norm(np.asarray(b))
      assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= tol * scale + 1e-7, path[0]
  return y, aux
