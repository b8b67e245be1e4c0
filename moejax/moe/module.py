"""`MoELayer`, the Flax nnx module of the MoE layer: its parameters placed on the mesh in the public layout
(`moe.params`), and its state (slot table, balancing bias, earlier micro-batches' counts)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import replicas as replicas_lib
from moejax.moe import routing
from moejax.moe.config import MoEConfig
from moejax.moe.layer import moe_apply
from moejax.moe.params import EXPERT_PARAMS, expert_names, init_params, param_specs
from moejax.moe.routing.hashed import initial_table
from moejax.runtime import mesh as mesh_lib


class Router(nnx.Module):
  """Holds one router's `kernel [d, width]` (and with router_bias its `bias [width]`), so the module's state paths
  follow the parameter layout."""

  def __init__(self, kernel: jax.Array, bias: jax.Array | None = None):
    self.kernel = nnx.Param(kernel)
    self.bias = None if bias is None else nnx.Param(bias)

  def params(self) -> dict:
    return {"kernel": self.kernel[...], **({} if self.bias is None else {"bias": self.bias[...]})}


class SlotTable(nnx.Variable):
  """The replication slot table [A, Z] of a layer: state, not a parameter (no gradient); the trainer
  re-plans it in place."""


class Shared(nnx.Module):
  """Holds the shared experts' w_in / w_out (/ w_gate), so the state paths follow the parameter layout."""

  def __init__(self, weights: dict):
    self.names = tuple(weights)
    for name, value in weights.items():
      setattr(self, name, nnx.Param(value))

  def params(self) -> dict:
    return {name: getattr(self, name)[...] for name in self.names}


class ExpertBias(nnx.Variable):
  """DeepSeek-V3's balancing bias [E] of a layer: state, not a parameter (no gradient); the trainer
  updates it after every step from the measured loads."""


class HashIndex(nnx.Variable):
  """Where each expert a hash names sits [E + Z] int32 (routing='hash'): the identity until a placement moves the
  experts (`moejax.placement.apply.permute_expert_state`); state, not a parameter."""


class HashTable(nnx.Variable):
  """Each token id's experts [V, K] int32 (routing='hash' with hash_vocab = V; DeepSeek-V4's tid2eid), in the experts'
  original numbering (a placement moves `HashIndex`, not this); frozen state, not a parameter."""


class BalanceCounts(nnx.Variable):
  """The choice counts of the optimizer step's earlier micro-batches [cfg.balance_counts_size]
  (balance_loss='global_batch'): input state the trainer sets per micro-batch; zeros outside training."""


class MoELayer(nnx.Module):
  """Flax nnx module owning the MoE parameters, each placed with its sharding on `mesh`, and with
  cfg.slots_per_device its slot table (`slot_expert`, a `SlotTable`, replicated), with cfg.bias_update_rate
  its balancing bias (`expert_bias`, an `ExpertBias` [E]; with zero experts [E + Z], frozen), with
  balance_loss='global_batch' the earlier micro-batches' choice counts (`balance_counts`, a `BalanceCounts`,
  replicated), with routing='hash' where each hashed expert sits (`hash_index`, a `HashIndex` [E + Z], replicated)
  and with hash_vocab = V each token id's experts (`hash_table`, a `HashTable` [V, K], replicated; initially the
  hash's: `routing.hashed.initial_table`; a checkpoint's is checked by `moe.layout.check_hash_table`).

  Call with x [tokens, d] or [batch, seq, d]; returns (y, aux) as `moe_apply`.
  """

  def __init__(self, cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs, dtype=jnp.float32):
    self.cfg, self.mesh = cfg, mesh
    cfg.check_mesh(*mesh_lib.axis_sizes(mesh))
    params = init_params(rngs.params(), cfg, dtype)
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    params = jax.tree.map(place, params, param_specs(cfg))
    for name in routing.router_names(cfg):
      setattr(self, name, Router(params[name]["kernel"], params[name].get("bias")))
    for name in EXPERT_PARAMS:  # None where the config has none (w_gate without gating, b_* without ffn_bias)
      setattr(self, name, nnx.Param(params[name]) if name in params else None)
    self.shared = Shared(params["shared"]) if cfg.num_shared_experts else None
    self.shared_gate = Router(params["shared_gate"]["kernel"]) if cfg.shared_gate else None
    table = None
    if cfg.slots_per_device is not None:
      table = replicas_lib.initial_table(
        cfg.num_experts, cfg.expert_holders(*mesh_lib.axis_sizes(mesh)), cfg.slots_per_device
      )
    # One assignment: nnx fixes an attribute's kind (data or static) when it is first set.
    self.slot_expert = (
      None if table is None else SlotTable(jax.device_put(jnp.asarray(table), NamedSharding(mesh, P())))
    )
    # With zero experts a bias [E + Z] is kept frozen (rate 0): LongCat-Flash's router's, read from its checkpoint.
    self.expert_bias = (
      None
      if cfg.bias_update_rate == 0 and not cfg.zero_experts
      else ExpertBias(
        jax.device_put(jnp.zeros((cfg.num_experts + cfg.zero_experts,), jnp.float32), NamedSharding(mesh, P()))
      )
    )
    self.balance_counts = (
      None
      if cfg.balance_loss != "global_batch"
      else BalanceCounts(jax.device_put(jnp.zeros((cfg.balance_counts_size,), jnp.float32), NamedSharding(mesh, P())))
    )
    self.hash_index = (
      HashIndex(jax.device_put(jnp.arange(cfg.router.scored, dtype=jnp.int32), NamedSharding(mesh, P())))
      if cfg.router.needs_token_ids
      else None
    )
    self.hash_table = (
      HashTable(jax.device_put(jnp.asarray(initial_table(cfg)), NamedSharding(mesh, P()))) if cfg.hash_vocab else None
    )
    self.rngs = rngs

  def params(self) -> dict:
    """The parameters as a plain dict in the public layout.

    Read at every call, not kept: each parameter is its own nnx Variable at its state path (the public contract of
    checkpoints and `from_hf`), and training and placement replace the Variables' arrays, so a dict built once would
    go stale. The reads are cheap: `[...]` hands back the held array (no copy), under jit once per trace."""
    params = {name: getattr(self, name).params() for name in routing.router_names(self.cfg)}
    params.update({name: getattr(self, name)[...] for name in expert_names(self.cfg)})
    if self.shared is not None:
      params["shared"] = self.shared.params()
    if self.shared_gate is not None:
      params["shared_gate"] = {"kernel": self.shared_gate.kernel[...]}
    return params

  def __call__(
    self,
    x: jax.Array,
    *,
    train: bool = False,
    rng: jax.Array | None = None,
    slot_expert: jax.Array | None = None,
    token_ids: jax.Array | None = None,
  ) -> tuple[jax.Array, dict]:
    """rng: the key of the router jitter in training; None draws it from the layer's own `rngs`.
    slot_expert: a replication slot table [A, Z] (see `moe_apply`); default the layer's own, if any.
    token_ids: the tokens' ids (x's shape without d), which routing='hash' routes by."""
    if rng is None and train and self.cfg.jitter > 0:
      rng = self.rngs.jitter()
    if slot_expert is None and self.slot_expert is not None:
      slot_expert = self.slot_expert[...]
    bias = None if self.expert_bias is None else self.expert_bias[...]
    prior = None if self.balance_counts is None else self.balance_counts[...]
    index = None if self.hash_index is None else self.hash_index[...]
    table = None if self.hash_table is None else self.hash_table[...]
    return moe_apply(
      self.params(),
      x,
      self.cfg,
      self.mesh,
      rng=rng,
      train=train,
      slot_expert=slot_expert,
      expert_bias=bias,
      balance_counts=prior,
      token_ids=token_ids,
      hash_index=index,
      hash_table=table,
    )
