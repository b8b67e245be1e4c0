"""The decoder families through the pipeline (`moejax.pipeline.step`): the training loss and gradients of a
`Decoder`, its layers split into stages over the mesh's 'stage' axis.

Which layers a stage runs (`moejax.pipeline.staging`): the last segment of the scanned layers (`moejax.models.layers`:
DeepSeek's MoE layers, all of Qwen3-MoE's) is split into the schedule's S equal runs of its repeats
(`Schedule.layer_stages`: p, 2p for dualpipev, p v for interleaved), stage k running run k on the device the schedule
puts it (`ticks.Plan.layout`); the layers before
it (DeepSeek's dense first layers) run on the first stage after the embeddings; the final norm, the head, the MTP
modules and the loss on the last. A stage is one program for every device (the stacked repeats [r, ...] sharded
over 'stage'), so the runs must be equal: r a multiple of S. The staged segment's parameters and state are split over
'stage'; everything else (embeddings, the first layers, norm, head, MTP modules) is replicated over it, used on the
first or last stage and its gradient summed over the stages (the embeddings' all-reduce of a pipeline whose first and
last stages share them).

Inside the pipeline's shard_map (manual over 'stage') each stage's MoE layers run their own shard_map over the
stage's ('node', 'gpu') devices, nested: jax 0.10.2 takes a nested shard_map whose mesh equals the context's, here
the mesh with 'stage' manual (`mesh.stage_manual`), so the modules are called with that mesh in place of the one
they were built on (`_on_stage_mesh`). Their expert parallelism, collectives and sharding constraints are the
stage's, unchanged.

A model with GLM-5's shared DSA layers passes a `sparse_attention.Stream` from stage to stage, as from layer to
layer: the activations and the last 'dsa' layer's choice of keys [B, S, K] int32 (forward only: it has no gradient),
so a stage may begin at a 'dsa_shared' layer.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models import backbone, lm_loss, sparse_attention
from moejax.models import layers as layers_lib
from moejax.models import state as state_lib
from moejax.models.decoder_config import DecoderConfig
from moejax.models.sharding import activation_spec
from moejax.pipeline import schedules, staging
from moejax.pipeline import step as step_lib
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib

AUX = ("expert_counts", "tokens_dropped", "tokens_overflowed")  # the MoE layers' per-layer statistics


@dataclasses.dataclass
class _Layers:
  """What `backbone.run_blocks` reads of a model, for a run of its layers."""

  cfg: DecoderConfig
  moe_cfg: object
  mesh: jax.sharding.Mesh
  segments: list


def _on_stage_mesh(module, mesh) -> None:
  """Every module of `module` that holds a mesh (the MoE layers, the decoder) holds `mesh` instead."""
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Module) and hasattr(node, "mesh"):
      node.mesh = mesh


def _replaced(tree: dict, path: tuple, value) -> dict:
  """The pure-dict `tree` with its leaf at `path` replaced by `value` (the rest shared)."""
  if len(path) == 1:
    return {**tree, path[0]: value}
  return {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


def _aux_stats(aux: dict) -> dict:
  return {name: aux[name] for name in AUX}


class PipelinedDecoder:
  """The training loss and gradients of a `Decoder` (graphdef, its state as pure dicts, built on the ('stage',
  'node', 'gpu') `mesh`) pipelined by `schedule` over 'stage', as the trainer's step computes them unpipelined:
  per micro-batch loss = cross-entropy sum / total + aux_loss / U (+ mtp_loss_coef x the MTP loss / U + the MTP
  modules' aux_loss / U)."""

  def __init__(
    self, graphdef, model_cfg: DecoderConfig, moe_cfg, mesh, schedule: str, loss_chunk: int, virtual_stages: int = 1
  ):
    self.stages = mesh_lib.require_stages(mesh)
    self.virtual_stages = virtual_stages
    self.segment = staging.staged_segment(model_cfg, self.stages, schedule, virtual_stages)
    staging.check_collective(moe_cfg, platform_lib.of_mesh(mesh))
    self.graphdef, self.cfg, self.moe_cfg, self.mesh = graphdef, model_cfg, moe_cfg, mesh
    self.schedule, self.loss_chunk = schedule, loss_chunk
    self.stage_mesh = mesh_lib.stage_manual(mesh)
    seg = layers_lib.segments(model_cfg)[self.segment]
    self.first_layers = seg.start
    self.stage_layers = seg.stop - seg.start
    self.layers_per_stage = (seg.stop - seg.start) // schedules.of(schedule, pipelined=True).layer_stages(
      self.stages, virtual_stages
    )

  def _is_staged(self, path) -> bool:
    return len(path) > 1 and path[0] == "segments" and path[1] == self.segment

  def shardings(self, tree):
    """A tree of NamedShardings of the state's layout on the mesh, the staged segment's leaves [r, ...] split over
    'stage' on their layer axis."""

    def place(path, sharding):
      if not self._is_staged(tuple(getattr(k, "key", k) for k in path)):
        return sharding
      return NamedSharding(self.mesh, P(mesh_lib.STAGE, *tuple(sharding.spec)[1:]))

    return jax.tree_util.tree_map_with_path(place, tree)

  def _split(self, tree: dict) -> tuple[dict, dict]:
    """(the staged segment's subtree {segments: {s: ...}}, the rest)."""
    segments = dict(tree.get("segments", {}))
    staged = segments.pop(self.segment, {})
    return {"segments": {self.segment: staged}}, {**tree, "segments": segments}

  def _model(self, w: step_lib.Weights):
    merge = lambda staged, shared: {**shared, "segments": {**shared["segments"], **staged["segments"]}}
    model = nnx.merge(self.graphdef, merge(w.staged, w.shared), merge(w.staged_rest, w.shared_rest))
    _on_stage_mesh(model, self.stage_mesh)
    return model

  def _rngs(self, key, first_layer):
    """The micro-batch's key streams as the unpipelined model draws them (a jitter key per layer, layer i's the
    stream's i-th), from layer `first_layer` on; None without router jitter."""
    if self.moe_cfg.jitter == 0:
      return None
    dropout_key, jitter_key = jax.random.split(key)
    rngs = nnx.Rngs(dropout=dropout_key, jitter=jitter_key)
    rngs.jitter.count.value = jnp.asarray(first_layer, jnp.uint32)
    return rngs

  def _run(self, model, segments, start, stop, x_BxSxD, batch, first_layer):
    view = _Layers(staging.sub_config(self.cfg, start, stop), self.moe_cfg, self.stage_mesh, segments)
    rngs = self._rngs(batch["key"], first_layer)
    x_BxSxD, aux, _ = backbone.run_blocks(view, x_BxSxD, train=True, rngs=rngs, token_ids=batch["inputs"])
    return x_BxSxD, aux

  def _view(self, start: int, stop: int) -> DecoderConfig:
    """The config of layers start .. stop - 1 alone (no MTP modules)."""
    return dataclasses.replace(staging.sub_config(self.cfg, start, stop), num_mtp_layers=0)

  def _with_earlier_counts(self, w: step_lib.Weights, part: int) -> step_lib.Weights:
    """w with the choice counts of the step's earlier micro-batches (w.before[part]['balance'], [m, ...] for the
    part's m MoE layers: 0 the first layers, 1 the stage's, 2 the MTP modules') in those layers' state, as the
    unpipelined step's scan carries them (balance_loss='global_batch'); w itself without them."""
    if w.before is None or "balance" not in w.before[part]:
      return w
    counts = w.before[part]["balance"]
    if part == 0:
      view = self._view(0, self.first_layers)
      return w._replace(shared_rest=state_lib.with_balance_counts(view, w.shared_rest, counts))
    if part == 1:
      view = self._view(self.first_layers, self.first_layers + self.layers_per_stage)
      segment = {"segments": {0: w.staged_rest["segments"][self.segment]}}
      segment = state_lib.with_balance_counts(view, segment, counts)["segments"][0]
      return w._replace(staged_rest={"segments": {self.segment: segment}})
    rest = w.shared_rest
    for k in range(len(counts)):
      rest = _replaced(rest, ("mtp", k, "block", "ffn", "moe", "balance_counts"), counts[k])
    return w._replace(shared_rest=rest)

  def _stats(self, aux: dict, w: step_lib.Weights, part: int) -> dict:
    """A part's statistics: aux_loss, the AUX ones and (global_batch) 'balance', its own choice counts [m, ...]
    (the layers return them plus the earlier micro-batches')."""
    stats = {"aux_loss": aux["aux_loss"], **_aux_stats(aux)}
    if "balance_counts" in aux:
      stats["balance"] = aux["balance_counts"] - (0.0 if w.before is None else w.before[part]["balance"])
    return stats

  def stages_of(self, num_micro: int) -> step_lib.Stages:
    scale = 1.0 / num_micro

    def first(w, batch):
      w = self._with_earlier_counts(w, 0)
      model = self._model(w)
      x_BxSxD = sparse_attention.begin(self.cfg, model.embed_tokens(batch["inputs"]))  # a Stream: 'dsa_shared'
      if self.first_layers == 0:
        return x_BxSxD, jnp.zeros((), jnp.float32), {}
      x_BxSxD, aux = self._run(model, model.segments[: self.segment], 0, self.first_layers, x_BxSxD, batch, 0)
      return x_BxSxD, aux["aux_loss"] * scale, self._stats(aux, w, 0)

    def stage(w, x_BxSxD, batch):
      w = self._with_earlier_counts(w, 1)
      model = self._model(w)
      start = self.first_layers + w.stage * self.layers_per_stage
      x_BxSxD, aux = self._run(
        model,
        model.segments[self.segment :],
        self.first_layers,
        self.first_layers + self.layers_per_stage,
        x_BxSxD,
        batch,
        start,
      )
      return x_BxSxD, aux["aux_loss"] * scale, self._stats(aux, w, 1)

    def last(w, y_BxSxD, batch):
      w = self._with_earlier_counts(w, 2)
      model = self._model(w)
      y_BxSxD = sparse_attention.activations(y_BxSxD)
      kernel_DxV, bias_V = model.output_layer()
      loss_sum, correct = lm_loss.head_cross_entropy_sums(
        model.head_features(y_BxSxD), kernel_DxV, bias_V, batch["targets"], batch["weights"], self.loss_chunk
      )
      stats = {"loss_sum": loss_sum, "correct": correct}
      loss = loss_sum / batch["total"]
      if len(model.mtp):
        stats.update(self._mtp(model, y_BxSxD, batch))
        if "balance_counts" in stats:
          stats["balance"] = stats.pop("balance_counts") - (0.0 if w.before is None else w.before[2]["balance"])
        stats["mtp_loss"] = stats["mtp_loss"] * scale
        loss += self.cfg.mtp_loss_coef * stats["mtp_loss"] + stats["mtp_aux_loss"] * scale
      return loss, stats

    return step_lib.Stages(first, stage, last)

  def _mtp(self, model, h_BxSxD, batch) -> dict:
    """DeepSeek-V3's MTP modules after the last layer, as `Decoder.__call__` runs them in training: their mean loss
    (`lm_loss.multi_token_loss`), aux loss and per-layer statistics [K, ...]."""
    tokens_BxS, rngs = batch["inputs"], self._rngs(batch["key"], self.cfg.num_layers)
    heads, aux_loss, stats = [], jnp.zeros((), jnp.float32), []
    for k, module in enumerate(model.mtp):
      ahead_BxS = jnp.roll(tokens_BxS, -(k + 1), axis=1)
      ids = backbone.routing_ids(self.cfg, self.moe_cfg, ahead_BxS)
      h_BxSxD, aux = module(h_BxSxD, model.embed_tokens(ahead_BxS), train=True, rngs=rngs, token_ids=ids)
      heads.append(model.head_logits(h_BxSxD, module.norm))
      aux_loss += aux.get("aux_loss", 0.0)
      stats.append({name: aux[name] for name in (*AUX, "balance_counts") if name in aux})
    loss = lm_loss.multi_token_loss(jnp.stack(heads), batch["targets"], batch["weights"])
    return {"mtp_loss": loss, "mtp_aux_loss": aux_loss, **jax.tree.map(lambda *a: jnp.stack(a), *stats)}

  def loss_and_grads(self, params: dict, rest: dict, batch_U: dict):
    """(gradients of `params` (float32 sums over the micro-batches), loss_sums [U], corrects [U], auxes) as the
    trainer's step has them; batch_U: inputs, targets, weights [U, B, S], key [U] (each micro-batch's model key),
    total [U] (the weights' sum over the step, repeated). auxes: aux_loss [U], expert_counts [U, M, E],
    tokens_dropped and tokens_overflowed [U, M] (the first layers', the stages' in order, the MTP modules'), with MTP
    modules mtp_loss [U] (already / U)."""
    num_micro = batch_U["inputs"].shape[0]
    staged, shared = self._split(params)
    staged_rest, shared_rest = self._split(rest)
    buffer = NamedSharding(self.stage_mesh, P(None, None, *activation_spec(self.cfg)))
    _, (dstaged, dshared), (first_U, stage_SxU, last_U) = step_lib.pipelined_loss_and_grads(
      self.stages_of(num_micro),
      step_lib.Weights(staged, shared, staged_rest, shared_rest),
      batch_U,
      self.mesh,
      self.schedule,
      constrain=lambda x: jax.lax.with_sharding_constraint(x, buffer),
      virtual_stages=self.virtual_stages,
    )
    grads = {**dshared, "segments": {**dshared["segments"], **dstaged["segments"]}}
    # The stages' per-layer statistics [S, U, m, ...] in layer order [U, S m, ...], between the first layers' and
    # the MTP modules'.
    in_order = lambda a: jnp.moveaxis(a, 0, 1).reshape(num_micro, -1, *a.shape[3:])
    parts = [first_U] if first_U else []
    parts += [jax.tree.map(in_order, {name: stage_SxU[name] for name in AUX})]
    if "mtp_loss" in last_U:
      parts.append({name: last_U[name] for name in AUX})
    auxes = {name: jnp.concatenate([part[name] for part in parts], axis=1) for name in AUX}
    auxes["aux_loss"] = jnp.sum(stage_SxU["aux_loss"], axis=0) + (first_U["aux_loss"] if first_U else 0.0)
    if "mtp_loss" in last_U:
      auxes["mtp_loss"] = last_U["mtp_loss"]
    return grads, last_U["loss_sum"], last_U["correct"], auxes
