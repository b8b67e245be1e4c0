"""The public parameter layout of an MoE layer (checkpoints and other frameworks rely on it): shapes,
shardings on the ('node', 'gpu') mesh, and a fresh initialisation."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe import expert_sharding, routing
from moejax.moe.config import MoEConfig

EXPERT_PARAMS = ("w_in", "w_out", "w_gate", "b_in", "b_out", "b_gate")  # [E, ...]: one row per expert


def expert_names(cfg: MoEConfig) -> tuple[str, ...]:
  """The layer's per-expert parameters: w_in, w_out (+ w_gate if gated), and with ffn_bias their biases."""
  names = ("w_in", "w_out", "w_gate") if cfg.gated else ("w_in", "w_out")
  return names + tuple("b" + name[1:] for name in names if cfg.ffn_bias)


def param_shapes(cfg: MoEConfig) -> dict:
  """The public parameter layout: name -> shape (checkpoints and other frameworks rely on it)."""
  e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
  shapes = {
    name: {"kernel": (d, width), **({"bias": (width,)} if cfg.router_bias else {})}
    for name, width in routing.router_widths(cfg).items()
  }
  every = {
    "w_in": (e, d, f),
    "w_out": (e, f, d),
    "w_gate": (e, d, f),
    "b_in": (e, f),
    "b_out": (e, d),
    "b_gate": (e, f),
  }
  shapes.update({name: every[name] for name in expert_names(cfg)})
  if cfg.num_shared_experts:
    w = cfg.shared_width
    shapes["shared"] = {"w_in": (d, w), "w_out": (w, d), **({"w_gate": (d, w)} if cfg.gated else {})}
  if cfg.shared_gate:
    shapes["shared_gate"] = {"kernel": (d, 1)}
  return shapes


def param_specs(cfg: MoEConfig) -> dict:
  """Routers replicated; the experts (and shared experts) as the expert sharding lays them out: whole experts
  over both mesh axes on the expert dimension, or experts over 'node' and d_ff over 'gpu'."""
  sharding = expert_sharding.of(cfg)
  specs = {name: {"kernel": P(), **({"bias": P()} if cfg.router_bias else {})} for name in routing.router_names(cfg)}
  specs.update({name: sharding.expert_specs[name] for name in expert_names(cfg)})
  weights = ("w_in", "w_out", "w_gate") if cfg.gated else ("w_in", "w_out")
  if cfg.num_shared_experts:
    specs["shared"] = {name: sharding.shared_specs[name] for name in weights}
  if cfg.shared_gate:
    specs["shared_gate"] = {"kernel": P()}
  return specs


def fan_ins(cfg: MoEConfig) -> dict:
  """Each parameter's fan-in, in `param_shapes`' layout: an expert leaf [E, X, ...] its X (a bias [E, X] too), a
  matrix of a group [X, ...] (routers, shared experts) its X, a router bias [E] its E."""
  return {
    name: {k: sub[0] for k, sub in shape.items()} if isinstance(shape, dict) else shape[1]
    for name, shape in param_shapes(cfg).items()
  }


def init_params(rng: jax.Array, cfg: MoEConfig, dtype=jnp.float32) -> dict:
  """Fresh parameters with fan-in scaled normal initialisation (`fan_ins`: biases [E, X] scaled by X^-1/2, router
  biases by E^-1/2: random, not zeros, so that a test sees them)."""
  shapes, fans = param_shapes(cfg), fan_ins(cfg)
  keys = dict(zip(["w_in", "w_out", "w_gate", *routing.router_names(cfg)], jax.random.split(rng, 5)))
  normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, dtype) / jnp.sqrt(fan_in)).astype(dtype)
  params = {}
  for i, (name, shape) in enumerate(shapes.items()):
    key = keys.get(name, jax.random.fold_in(rng, 100 + i))
    if not isinstance(shape, dict):  # expert weights [E, fan_in, ...]
      params[name] = normal(key, shape, fans[name])
    else:  # a group of matrices [fan_in, ...]
      subkeys = [key] if len(shape) == 1 else jax.random.split(key, len(shape))
      params[name] = {k: normal(sk, sub, fans[name][k]) for sk, (k, sub) in zip(subkeys, shape.items())}
  return params
