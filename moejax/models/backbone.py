"""What SMILE's models (`blocks`, `language_model`) and the decoder families (`decoder`) share: the MoE layer as a
block's FFN (`MoEFFN`) and the loop over a model's blocks with its MoE layers' aux (`run_blocks`). Both import it;
it imports neither."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from moejax.models import grad_sync as grad_sync_lib
from moejax.models.sharding import activation_spec, model_param_specs
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.module import MoELayer


class MoEFFN(nnx.Module):
  """The expert-parallel MoE layer as an FFN: x [B, S, d] (batch sharded over the mesh) -> (y, aux).

  `moe` is the layer (`MoELayer`); its name is part of every state path (`blocks/i/ffn/moe/...`), which checkpoints
  and `from_hf` rely on. Calls the layer with the step's key, so router jitter draws from it. aux also holds the
  layer's traffic_rows and expert_ids [B * S, K] (each token's routed experts, from the layer's aux); under jit
  they cost nothing unless used.
  """

  def __init__(self, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.moe = MoELayer(moe_cfg, mesh, rngs=nnx.Rngs(params=rngs.params()), dtype=param_dtype)

  def __call__(self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    y_BxSxD, aux = self.moe(x_BxSxD, train=train, rng=rng)
    return y_BxSxD, {k: aux[k] for k in ("aux_loss", "expert_counts", "tokens_dropped", "tokens_overflowed",
                                         "traffic_rows", "expert_ids", "balance_counts") if k in aux}


REMAT_POLICIES = {"full": None, "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "save_exchanged": jax.checkpoint_policies.save_only_these_names(path_lib.EXCHANGED)}


def _remat(remat: str):
  """A training block call (block, x, rngs) -> (x, aux) whose backward recomputes what `remat` does not keep."""
  return nnx.remat(lambda block, x, rngs: block(x, train=True, rngs=rngs), policy=REMAT_POLICIES[remat])


def run_blocks(model, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None, start=0, details: bool = False):
  """x [B, S, d] through `model.blocks` (each x -> (x, aux), or with a cache (x, aux, cache)), the activations
  kept sharded as `activation_spec` says, each block's gradients reduced before the block below's with
  grad_sync='prioritized', each training block rematerialised as cfg.remat says -> (x, aux, the new cache or []).

  aux: aux_loss (the MoE layers' summed), expert_counts [M, E], tokens_dropped [M], tokens_overflowed [M] (and
  balance_counts [M, ...] with balance_loss='global_batch'; with details, expert_ids [M, B * S, K] and traffic_rows
  [M, hops, A, A]) for the M MoE layers in order."""
  cfg, moe_cfg = model.cfg, model.moe_cfg
  dtype = jnp.dtype(cfg.dtype)
  batch_sharding = NamedSharding(model.mesh, activation_spec(cfg))
  constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
  x_BxSxD = constrain(x_BxSxD)
  auxes, new_cache = [], []
  for i, block in enumerate(model.blocks):
    if cfg.grad_sync == "prioritized":
      specs = model_param_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), cfg, moe_cfg, model.mesh)
      x_BxSxD = grad_sync_lib.reduce_before_passing_on(block, x_BxSxD, model.mesh, specs)
    if cache is None and train and cfg.remat != "none":
      x_BxSxD, aux = _remat(cfg.remat)(block, x_BxSxD, rngs)
    elif cache is None:
      x_BxSxD, aux = block(x_BxSxD, train=train, rngs=rngs)
    else:
      x_BxSxD, aux, layer_cache = block(x_BxSxD, train=train, rngs=rngs, cache=(*cache[i], start))
      new_cache.append(layer_cache)
    x_BxSxD = constrain(x_BxSxD.astype(dtype))
    if aux:
      auxes.append(aux)
  stack = lambda name: jnp.stack([a[name] for a in auxes])
  aux = {
      "aux_loss": sum((a["aux_loss"] for a in auxes), jnp.zeros((), jnp.float32)),
      "expert_counts": stack("expert_counts") if auxes else jnp.zeros((0, moe_cfg.num_experts), jnp.int32),
      **{name: stack(name) if auxes else jnp.zeros((0,), jnp.int32) for name in ("tokens_dropped", "tokens_overflowed")},
  }
  if auxes and "balance_counts" in auxes[0]:  # balance_loss='global_batch': the next micro-batch's input
    aux["balance_counts"] = stack("balance_counts")
  if details and auxes:
    aux.update({name: stack(name) for name in ("expert_ids", "traffic_rows")})
  return x_BxSxD, aux, new_cache
