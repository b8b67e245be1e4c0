"""Inputs of the MoE layer at a sweep point: parameters on a mesh (routers built to route uniformly
with sim.balanced_router) and random tokens."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import routing
from moejax.moe.config import MoEConfig
from moejax.moe.params import init_params, param_specs
from moejax.runtime.mesh import AXES


def _harmonic_frame(d: int, width: int) -> np.ndarray:
  """[d, width] unit columns w_e = R^e w_0, R a rotation of order `width` (angle 2 pi j / width in
  coordinate plane j): x ~ N(0, I) is invariant under R, so every column is the argmax of x @ w
  equally often, however many more columns than dimensions there are."""
  planes = d // 2
  angles = 2 * np.pi * np.outer(np.arange(width), np.arange(1, planes + 1)) / width
  frame = np.stack([np.cos(angles), np.sin(angles)], axis=-1).reshape(width, 2 * planes) / np.sqrt(planes)
  return np.pad(frame, ((0, 0), (0, d - 2 * planes))).T


def balanced_routers(cfg: MoEConfig, seed: int) -> dict:
  """Router kernels that route x ~ N(0, I) uniformly, standing in for a router trained with a
  load-balancing loss (a fresh random router favours the experts whose columns happen to be long
  or central: with d 32 and 128 experts the busiest gets about 4x the mean).

  When all routers have at most d columns together, the columns are orthonormal: all logits are
  i.i.d., so the choices are uniform and independent (the node and local choices of 'bilevel'
  too). Otherwise each router is a randomly rotated `_harmonic_frame`: each router's choices are
  uniform, but with several routers their choices may be correlated.
  """
  rng = np.random.default_rng(seed)
  names, d = routing.router_names(cfg), cfg.d_model
  widths = [routing.router_widths(cfg)[name] for name in names]
  if sum(widths) <= d:
    kernels = np.split(np.linalg.qr(rng.standard_normal((d, sum(widths))))[0], np.cumsum(widths)[:-1], axis=1)
  else:
    kernels = [np.linalg.qr(rng.standard_normal((d, d)))[0] @ _harmonic_frame(d, w) for w in widths]
  return {name: {"kernel": kernel} for name, kernel in zip(names, kernels)}


def layer_params(cfg: MoEConfig, mesh, seed: int, dtype, balanced_router: bool) -> dict:
  """Fresh parameters (routers from `balanced_routers` if balanced_router) placed on `mesh`."""
  params = init_params(jax.random.key(seed), cfg, dtype)
  if balanced_router:
    params.update(jax.tree.map(lambda k: jnp.asarray(k, dtype), balanced_routers(cfg, seed)))
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs(cfg))


def random_tokens(mesh, tokens: int, d: int, seed: int, dtype) -> jax.Array:
  """x [tokens, d] ~ N(0, I), sharded over the mesh's devices."""
  x = jax.random.normal(jax.random.key(seed), (tokens, d), dtype)
  return jax.device_put(x, NamedSharding(mesh, P(AXES)))
