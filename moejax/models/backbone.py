"""What SMILE's models (`blocks`, `language_model`) and the decoder families (`decoder`) share: the MoE layer as a
block's FFN (`MoEFFN`), the loop over a model's layers, unrolled or scanned (`fold_layers`), and the blocks' forward
with its MoE layers' aux (`run_blocks`). Both import it; it imports neither."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from moejax.models import grad_sync as grad_sync_lib
from moejax.models import layers as layers_lib
from moejax.models import sparse_attention
from moejax.models.sharding import activation_spec, model_param_specs
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.moe.module import MoELayer


class Halves(nnx.Module):
  """A block run as two halves: `attend` (the token mixer with its residual; with a cache (*arrays, start), (x,
  arrays)), then `feed_forward` (the FFN on `ffn_input(x)`, added back by `after_experts`). x -> (x, aux), or with a
  cache (x, aux, cache). ExFlow's decode calls the halves apart, the MoE layer's hop between them
  (`moejax.infer.exflow`)."""

  def feed_forward(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, token_ids=None):
    """The FFN half with its residual -> (x, aux). token_ids [B, S]: what routing='hash' routes by."""
    rng = rngs.jitter() if train and rngs is not None else None
    y_BxSxD, aux = self.ffn(self.ffn_input(x_BxSxD), train=train, rng=rng, token_ids=token_ids)
    return self.after_experts(x_BxSxD, y_BxSxD)[0], aux

  def __call__(self, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None, token_ids=None):
    ffn = lambda x: self.feed_forward(x, train=train, rngs=rngs, token_ids=token_ids)
    if cache is None:
      return ffn(self.attend(x_BxSxD, train=train, rngs=rngs))
    x_BxSxD, cache = self.attend(x_BxSxD, train=train, rngs=rngs, cache=cache)
    return *ffn(x_BxSxD), cache


class MoEFFN(nnx.Module):
  """The expert-parallel MoE layer as an FFN: x [B, S, d] (batch sharded over the mesh) -> (y, aux).

  `moe` is the layer (`MoELayer`); its name is part of every state path (`segments/s/j/ffn/moe/...`, `blocks/i/ffn/moe/...`), which checkpoints
  and `from_hf` rely on. Calls the layer with the step's key, so router jitter draws from it. aux also holds the
  layer's traffic_rows and expert_ids [B * S, K] (each token's routed experts, from the layer's aux); under jit
  they cost nothing unless used.
  """

  def __init__(self, moe_cfg: MoEConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.moe = MoELayer(moe_cfg, mesh, rngs=nnx.Rngs(params=rngs.params()), dtype=param_dtype)

  def __call__(
    self, x_BxSxD: jax.Array, *, train: bool, rng: jax.Array | None, token_ids=None
  ) -> tuple[jax.Array, dict]:
    """token_ids [B, S]: the tokens' ids, which routing='hash' routes by (None for any other routing)."""
    token_ids = token_ids if self.moe.cfg.router.needs_token_ids else None  # a model mixing hash and other layers
    y_BxSxD, aux = self.moe(x_BxSxD, train=train, rng=rng, token_ids=token_ids)
    return y_BxSxD, {
      k: aux[k]
      for k in (
        "aux_loss",
        "expert_counts",
        "tokens_dropped",
        "tokens_overflowed",
        "traffic_rows",
        "expert_ids",
        "balance_counts",
      )
      if k in aux
    }


REMAT_POLICIES = {
  "full": None,
  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "save_exchanged": jax.checkpoint_policies.save_only_these_names(path_lib.EXCHANGED),
}


def _remat(remat: str):
  """A training block call (block, x, rngs) -> (x, aux) whose backward recomputes what `remat` does not keep."""
  return nnx.remat(
    lambda block, x, rngs, token_ids=None: block(x, train=True, rngs=rngs, token_ids=token_ids),
    policy=REMAT_POLICIES[remat],
  )


def routing_ids(cfg, moe_cfg, token_ids):
  """The token ids [B, S] a model's MoE layers route by: `token_ids` where some layer's routing needs them ('hash',
  or a layer `DecoderConfig.hash_layers` marks: DeepSeek-V4's), else None (no other routing reads them; `MoEFFN`
  passes them only to a layer that does)."""
  hashed = any(getattr(cfg, "hash_layers", None) or ())
  return token_ids if hashed or moe_cfg.router.needs_token_ids else None


def fold_layers(model, step, carry, inputs=None, rngs: nnx.Rngs | None = None):
  """step(block, carry, input, rngs) -> (carry, output) over the model's layers in order -> (carry, outputs).

  Unrolled (`model.blocks`): a Python loop. Scanned (`model.segments`, `moejax.models.layers`): one jax.lax.scan per
  segment over its repeats, each iteration running the unit's sub-layers, each block a module merged from its
  repeat's slice of the stacked state; the rngs' state is carried, so each block draws the keys it draws unrolled.
  The blocks' own state is read, not written back (the trainer sets slot tables, biases and counts from outside).
  inputs, outputs: layer trees (`layers.map_outputs`): per layer, or per segment per sub-layer stacked [repeats, ...]."""
  if not model.cfg.scan_layers:
    outputs = []
    for i, block in enumerate(model.blocks):
      carry, out = step(block, carry, None if inputs is None else inputs[i], rngs)
      outputs.append(out)
    return carry, outputs
  rng_graphdef, rng_state = nnx.split(rngs) if rngs is not None else (None, None)
  outputs = []
  for s, (seg, modules) in enumerate(zip(layers_lib.segments(model.cfg), model.segments)):
    graphdefs, states = zip(*(nnx.split(module) for module in modules))

    def body(carried, xs, graphdefs=graphdefs, period=seg.period):
      inner, rng_state = carried
      local_rngs = None if rng_graphdef is None else nnx.merge(rng_graphdef, rng_state)
      outs = []
      for j in range(period):
        block = nnx.merge(graphdefs[j], xs[0][j])
        inner, out = step(block, inner, None if xs[1] is None else xs[1][j], local_rngs)
        outs.append(out)
      return (inner, None if local_rngs is None else nnx.split(local_rngs)[1]), outs

    xs = (list(states), None if inputs is None else inputs[s])
    if seg.repeats == 1:  # a loop of one iteration: the body as it is (its arrays' repeat 0), outputs [1, ...]
      (carry, rng_state), outs = body((carry, rng_state), jax.tree.map(lambda a: a[0], xs))
      outs = jax.tree.map(lambda a: a[None], outs)
    else:
      (carry, rng_state), outs = jax.lax.scan(body, (carry, rng_state), xs)
    outputs.append(outs)
  if rngs is not None:
    nnx.update(rngs, rng_state)
  return carry, outputs


def run_blocks(
  model, x_BxSxD, *, train: bool, rngs: nnx.Rngs | None, cache=None, start=0, details: bool = False, token_ids=None
):
  """x [B, S, d] through the model's layers (`fold_layers`; each block x -> (x, aux), or with a cache (x, aux,
  cache)), the activations kept sharded as `activation_spec` says, each block's gradients reduced before the block
  below's with grad_sync='prioritized', each training block rematerialised as cfg.remat says -> (x, aux, the new
  cache or []).

  cache: a layer tree of (c1, c2) pairs (`moejax.infer.cache.init_cache`), the new one laid out alike.
  token_ids: the tokens' ids [B, S] (x's), passed to every block's MoE layer where its routing needs them ('hash').
  A model with 'dsa_shared' layers passes a `sparse_attention.Stream` from layer to layer (x beside the last 'dsa'
  layer's top-k), begun here; the steps act on its x. Given a Stream (a pipeline stage's input), the Stream is what
  comes out.
  aux: aux_loss (the MoE layers' summed), expert_counts [M, E], tokens_dropped [M], tokens_overflowed [M] (and
  balance_counts [M, ...] with balance_loss='global_batch'; with details, expert_ids [M, B * S, K] and traffic_rows
  [M, hops, A, A]) for the M MoE layers in order."""
  cfg, moe_cfg = model.cfg, model.moe_cfg
  dtype = jnp.dtype(cfg.dtype)
  batch_sharding = NamedSharding(model.mesh, activation_spec(cfg))
  constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
  ids = routing_ids(cfg, moe_cfg, token_ids)

  def step(block, x_BxSxD, layer_cache, rngs):  # x: activations, or a `sparse_attention.Stream` (their x alone tied)
    if cfg.grad_sync == "prioritized":  # in a scan, inside the body: each layer's own bucket
      specs = model_param_specs(nnx.to_pure_dict(nnx.state(block, nnx.Param)), cfg, moe_cfg, model.mesh)
      tie = lambda x: grad_sync_lib.reduce_before_passing_on(block, x, model.mesh, specs)
      x_BxSxD = sparse_attention.apply_x(tie, x_BxSxD)
    new_cache = None
    if cache is None and train and cfg.remat != "none":
      x_BxSxD, aux = _remat(cfg.remat)(block, x_BxSxD, rngs, ids)
    elif cache is None:
      x_BxSxD, aux = block(x_BxSxD, train=train, rngs=rngs, token_ids=ids)
    else:
      x_BxSxD, aux, new_cache = block(x_BxSxD, train=train, rngs=rngs, cache=(*layer_cache, start), token_ids=ids)
    return sparse_attention.apply_x(lambda x: constrain(x.astype(dtype)), x_BxSxD), (aux, new_cache)

  streamed = isinstance(x_BxSxD, sparse_attention.Stream)
  x_BxSxD = sparse_attention.begin(cfg, sparse_attention.apply_x(constrain, x_BxSxD), cache)  # 'dsa_shared' layers
  x_BxSxD, outputs = fold_layers(model, step, x_BxSxD, cache, rngs)
  x_BxSxD = x_BxSxD if streamed else sparse_attention.activations(x_BxSxD)
  new_cache = [] if cache is None else layers_lib.map_outputs(lambda o: o[1], outputs, cfg)
  stacked = layers_lib.stack_selected(layers_lib.map_outputs(lambda o: o[0], outputs, cfg), cfg, cfg.is_moe)
  if stacked is None:
    aux = {
      "aux_loss": jnp.zeros((), jnp.float32),
      "expert_counts": jnp.zeros((0, moe_cfg.num_experts), jnp.int32),
      "tokens_dropped": jnp.zeros((0,), jnp.int32),
      "tokens_overflowed": jnp.zeros((0,), jnp.int32),
    }
    return x_BxSxD, aux, new_cache
  aux = {
    "aux_loss": jnp.sum(stacked["aux_loss"]),
    **{name: stacked[name] for name in ("expert_counts", "tokens_dropped", "tokens_overflowed")},
  }
  if "balance_counts" in stacked:  # balance_loss='global_batch': the next micro-batch's input
    aux["balance_counts"] = stacked["balance_counts"]
  if details:
    aux.update({name: stacked[name] for name in ("expert_ids", "traffic_rows")})
  return x_BxSxD, aux, new_cache
