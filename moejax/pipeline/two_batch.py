"""Two-micro-batch overlap without a pipeline (pipeline.schedule='two_batch'): each micro-batch of the training step
split in two halves whose blocks run interleaved, so that one half's MoE dispatch and combine can run while the
other half's attention and experts compute (MaxText's batch split, SGLang's two-batch overlap; the cost model's
`cost.one_device(..., two_batch=True)`).

The halves are the micro-batch's even and odd rows (each device's rows split in place: B / devices even). One loop
over the layers carries both: every layer runs on half 0, then on half 1, with no data between them, so XLA may run
half 1's attention and experts under half 0's all-to-alls (the overlap is XLA's scheduling on a GPU; on CPU the
step is only checked to be right). The final norm, the head, the MTP modules and the loss then run on each half.

Each half is a micro-batch of its own to the statistics: its balance loss over its own tokens, its MTP loss a mean
over its own, both averaged over the two halves; the expert counts, drops and the task loss summed. The step is
therefore the plain step's with twice the micro-batches, micro-batch 2i the even rows of micro-batch i and 2i + 1
its odd rows (`tests/test_two_batch.py`: equal in fp32). balance_loss='global_batch' is refused (`check`): half 1's
balance loss would need half 0's counts of the same layer, made in the same loop iteration.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from moejax.models import backbone, lm_loss, sparse_attention
from moejax.models import layers as layers_lib
from moejax.models.decoder_config import DecoderConfig
from moejax.models.sharding import activation_spec
from moejax.pipeline import schedules
from moejax.validation import require

SCHEDULE = schedules.TwoBatch.name
HALF_SUMS = ("expert_counts", "tokens_dropped", "tokens_overflowed")  # summed over the halves; the losses averaged


def check(model_cfg, moe_cfg, config) -> None:
  """ConfigError naming the field for a config the two-batch step cannot run."""
  require(
    isinstance(model_cfg, DecoderConfig),
    "model.family",
    getattr(model_cfg, "family", type(model_cfg).__name__),
    "a decoder family with pipeline.schedule='two_batch'",
  )
  require(
    moe_cfg.balance_loss != "global_batch",
    "moe.balance_loss",
    moe_cfg.balance_loss,
    "not 'global_batch' with pipeline.schedule='two_batch' (half 1's loss would need half 0's counts of the "
    "same layer, made in the same iteration of the layers' loop)",
  )
  require(
    model_cfg.grad_sync != "prioritized",
    "model.grad_sync",
    model_cfg.grad_sync,
    "not 'prioritized' with pipeline.schedule='two_batch' (its per-layer reduction hooks one activation)",
  )
  rows, devices = config.batch_size // config.micro_batches, config.mesh.nodes * config.mesh.gpus_per_node
  require(
    rows % (2 * devices) == 0,
    "batch_size",
    config.batch_size,
    f"micro-batches of rows a multiple of 2 x {devices} devices with pipeline.schedule='two_batch' (each "
    f"device's rows split in two halves; batch_size / micro_batches = {rows})",
  )


def halves(a_BxT: jax.Array | None) -> tuple:
  """(even rows, odd rows) of a [B, ...] array (a device's B / devices rows split in place), or (None, None)."""
  if a_BxT is None:
    return None, None
  pairs = a_BxT.reshape(a_BxT.shape[0] // 2, 2, *a_BxT.shape[1:])
  return pairs[:, 0], pairs[:, 1]


def _layers(model, xs: tuple, rngs: nnx.Rngs | None, tokens: tuple) -> tuple[tuple, list]:
  """Both halves' x [B/2, S, d] through the model's layers in one loop (`backbone.fold_layers`), each layer on half 0
  then half 1 -> (the halves' x, each half's aux as `backbone.run_blocks` returns it). tokens: the halves' ids."""
  cfg = model.cfg
  constrain = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(model.mesh, activation_spec(cfg)))
  call = (
    (lambda block, x, r, ids: block(x, train=True, rngs=r, token_ids=ids))
    if cfg.remat == "none"
    else backbone._remat(cfg.remat)
  )
  ids = tuple(backbone.routing_ids(model.cfg, model.moe_cfg, t) for t in tokens)

  def step(block, pair, _, rngs):  # each half's x, or its `sparse_attention.Stream` ('dsa_shared' layers)
    outs = [call(block, x, rngs, i) for x, i in zip(pair, ids)]
    cast = lambda x: constrain(x.astype(jnp.dtype(cfg.dtype)))
    return tuple(sparse_attention.apply_x(cast, x) for x, _ in outs), tuple(aux for _, aux in outs)

  pair = tuple(sparse_attention.begin(cfg, constrain(x)) for x in xs)
  pair, outputs = backbone.fold_layers(model, step, pair, None, rngs)
  pair = tuple(sparse_attention.activations(x) for x in pair)
  auxes = []
  for h in range(2):
    stacked = layers_lib.stack_selected(layers_lib.map_outputs(lambda o, h=h: o[h], outputs, cfg), cfg, cfg.is_moe)
    auxes.append({"aux_loss": jnp.sum(stacked["aux_loss"]), **{name: stacked[name] for name in HALF_SUMS}})
  return pair, auxes


def _head_and_loss(model, tokens_BxS, x_BxSxD, targets_BxS, weights_BxS, aux, chunk, rngs):
  """One half after the layers, as `Decoder.__call__` with `objective.model_loss_sums`: (loss sum, correct, aux with
  the MTP modules' mtp_loss, mtp_aux_loss and their layers' statistics appended)."""
  kernel_DxV, bias_V = model.output_layer()
  loss_sum, correct = lm_loss.head_cross_entropy_sums(
    model.head_features(x_BxSxD), kernel_DxV, bias_V, targets_BxS, weights_BxS, chunk
  )
  if not len(model.mtp):
    return loss_sum, correct, aux
  h_BxSxD, features, aux["mtp_aux_loss"] = x_BxSxD, [], jnp.zeros((), jnp.float32)
  for k, module in enumerate(model.mtp):
    ahead_BxS = jnp.roll(tokens_BxS, -(k + 1), axis=1)
    ids = backbone.routing_ids(model.cfg, model.moe_cfg, ahead_BxS)
    h_BxSxD, mtp_aux = module(h_BxSxD, model.embed_tokens(ahead_BxS), train=True, rngs=rngs, token_ids=ids)
    features.append(model.head_features(h_BxSxD, module.norm))
    aux["mtp_aux_loss"] += mtp_aux.get("aux_loss", 0.0)
    for name in HALF_SUMS:
      aux[name] = jnp.concatenate([aux[name], mtp_aux[name][None].astype(aux[name].dtype)])
  aux["mtp_loss"] = lm_loss.mean_over_modules(  # the loss `objective.model_loss_sums` takes
    lambda k, t, w: lm_loss.head_cross_entropy_sums(features[k], kernel_DxV, bias_V, t, w, chunk)[0],
    len(features),
    targets_BxS,
    weights_BxS,
  )
  return loss_sum, correct, aux


def model_loss_sums(model, inputs_BxS, positions_BxP, targets_BxP, weights_BxP, *, chunk: int, rngs):
  """`objective.model_loss_sums` of a `Decoder` with the micro-batch's halves interleaved: the loss sum and correct
  count summed over the halves, aux_loss, mtp_loss and mtp_aux_loss their means, the per-layer statistics summed."""
  require(positions_BxP is None, "pipeline.schedule", SCHEDULE, "a causal decoder's loss at every position")
  tokens = halves(inputs_BxS)
  (x0, x1), auxes = _layers(model, tuple(model.embed_tokens(t) for t in tokens), rngs, tokens)
  outs = [
    _head_and_loss(model, t, x, y, w, aux, chunk, rngs)
    for t, x, y, w, aux in zip(tokens, (x0, x1), halves(targets_BxP), halves(weights_BxP), auxes)
  ]
  (loss0, correct0, aux0), (loss1, correct1, aux1) = outs
  aux = {name: aux0[name] + aux1[name] if name in HALF_SUMS else (aux0[name] + aux1[name]) / 2 for name in aux0}
  return loss0 + loss1, correct0 + correct1, aux
