"""Training the language models (SMILE's and the decoder families): sharded state, the train step, and `train`, which
sets up a run (its config checked once, `moejax.train.config`) and hands it to `moejax.train.loop`.

One jitted step runs over the whole ('node', 'gpu') mesh: the batch is sharded over both axes, dense parameters are
replicated (data parallel) and experts are sharded by the MoE layer (expert parallel); XLA inserts the gradient
all-reduce. The step accumulates gradients over micro-batches in float32 (`moejax.train.step`) and adds the auxiliary
losses of all MoE layers to the task loss (SMILE Eq. 5); the optimizer (`optim.optimizer`) updates the parameters, or
an fp32 master copy in its state that the parameters are cast from (`moejax.train.precision`).
"""

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import checkpoint as checkpoint_lib
from moejax import workdir_guard
from moejax.cost import expert_backend
from moejax.data import tokenizer as tokenizer_lib
from moejax.models import hf_load, lm_loss
from moejax.models import state as state_lib
from moejax.models.config import ModelConfig, tokens_per_call
from moejax.models.decoder_config import DecoderConfig
from moejax.moe import collective as collective_lib
from moejax.moe.config import MoEConfig
from moejax.pipeline import section as pipeline_section
from moejax.pipeline import two_batch as two_batch_lib
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES
from moejax.train import config as config_lib
from moejax.train import guard as guard_lib
from moejax.train import heldout as heldout_lib
from moejax.train import inputs as inputs_lib
from moejax.train import loop as loop_lib
from moejax.train import metrics as metrics_lib
from moejax.train import objective, optim, precision, run_summary, train_state
from moejax.train import resume as resume_lib
from moejax.train import step as step_lib


class Trainer:
  """The model's functional pieces on `mesh`: sharded state init, the jitted train step.

    Of `config` it reads seed, steps, optim and data.mask_prob (and with moe.expert_backend 'auto', resolved here for
    this mesh's devices, batch_size, micro_batches and seq_len); `tok` supplies the special ids.

    state: {'params', 'opt_state' (with optim.master_dtype a `precision.MasterState`: the master copy, sharded like
  the params, and the optimizer's state), 'step' (int32), 'rng' (uint32 key data)}, and with replication
  (moe.slots_per_device) 'slot_tables' [M, A, Z] int32, the MoE layers' slot tables: not optimised,
  replicated, checkpointed with the rest, written into each layer's `SlotTable` in `rest` by the step
  and re-planned between steps by the loop (same shape, so the compiled step is reused); with
  auxiliary-loss-free balancing (moe.bias_update_rate = u > 0) 'expert_bias' [M, E] float32, the MoE
  layers' balancing biases (DeepSeek-V3 Sec. 2.1.2): not optimised (no gradient reaches them), replicated,
  checkpointed with the rest, written into each layer's `ExpertBias` in `rest` by the step and updated at
  the end of the step from the step's expert loads (`step.update_expert_bias`). Every array is placed by
  `state_shardings` (`moejax.train.train_state`), declared once here together with the batch sharding.

    heldout: the step also returns metrics['heldout_loss'], the held-out loss of the state it produced on the steps
  log.eval_every asks for (`moejax.train.heldout`; NaN on the others), and takes `rest` as (rest, held-out tokens
  [K, B, S], sharded like a batch).
  """

  def __init__(
    self,
    config,
    model_cfg: ModelConfig | DecoderConfig,
    moe_cfg: MoEConfig,
    mesh,
    tok: tokenizer_lib.Tokenizer | objective.TokenIds,
    *,
    donate: bool = True,
    heldout: bool = False,
  ):
    tokenizer_lib.require_fits(tok, model_cfg.vocab_size)  # before anything compiles
    # 'auto': the fastest measured for one layer call's tokens, asked here (a trainer from parts may lack batch fields)
    if moe_cfg.backend_kind.needs_resolving:
      moe_cfg = expert_backend.resolve(moe_cfg, tokens_per_call(config), mesh, "fwd_bwd")
    self.config, self.model_cfg, self.moe_cfg, self.mesh, self.tok = config, model_cfg, moe_cfg, mesh, tok
    self.donate, self.heldout = donate, heldout
    self.graphdef, abstract_params, abstract_rest = state_lib.abstract_state(model_cfg, moe_cfg, mesh, config.seed)
    # Pipeline parallelism (`moejax.pipeline`): the staged layers' parameters split over the mesh's 'stage' axis.
    self.pipeline = pipeline_section.of_config(config, model_cfg, moe_cfg, mesh, self.graphdef)
    # pipeline.schedule='two_batch': each micro-batch's halves through the layers interleaved (`moejax.pipeline.two_batch`).
    self.model_loss_sums = (
      two_batch_lib.model_loss_sums if pipeline_section.two_batch(config) else objective.model_loss_sums
    )
    self.loss_chunk = config.get("loss_chunk", lm_loss.LOSS_CHUNK)  # vocabulary columns per chunk of the loss
    o = config.optim
    self.learning_rate = optim.warmup_then_decay(
      o.learning_rate, o.warmup_steps, o.decay_steps or config.steps, o.decay, o.end_fraction
    )
    self.tx = optim.optimizer(o, self.learning_rate, abstract_params)
    self.replicated = NamedSharding(mesh, P())
    self.spike_factor = guard_lib.settings(config)["loss_spike_factor"]  # > 0: a loss-spike window in the state
    self.state_shardings = train_state.shardings(
      self.tx, model_cfg, abstract_params, abstract_rest, self.replicated, self.pipeline, self.spike_factor > 0
    )
    self.rest_shardings = jax.tree.map(lambda a: a.sharding, abstract_rest)
    self.batch_sharding = NamedSharding(mesh, P(None, AXES))  # tokens [micro_batches, rows, seq_len]
    self._complete = train_state.completion(self.tx, config.seed, self.state_shardings)
    self.abstract_state = train_state.abstract(
      self._complete, model_cfg, abstract_params, abstract_rest, self.state_shardings
    )
    rest_in = (self.rest_shardings, self.batch_sharding) if heldout else self.rest_shardings
    self.step = jax.jit(
      self._step,
      in_shardings=(self.state_shardings, rest_in, self.batch_sharding),
      out_shardings=(self.state_shardings, self.replicated),
      donate_argnums=0 if donate else (),
    )

  def with_moe(self, moe_cfg: MoEConfig) -> "Trainer":
    """The same trainer with another MoE layer config (same parameters and state layout)."""
    return Trainer(self.config, self.model_cfg, moe_cfg, self.mesh, self.tok, donate=self.donate, heldout=self.heldout)

  def init(self):
    """(state, rest): fresh sharded state (with config.init_from, the checkpoint's weights and balancing biases), and
    the model's non-parameter state (constant; the step takes the slot tables from the state)."""
    if self.config.get("init_from"):
      _, params, rest = hf_load.load_state(
        self.config.init_from, self.model_cfg, self.moe_cfg, self.mesh, self.config.seed
      )
    else:
      params, rest = state_lib.init_state(self.model_cfg, self.moe_cfg, self.mesh, self.config.seed)
    state = self._complete(params)
    tables = state_lib.slot_tables(self.model_cfg, rest)
    if tables is not None:
      state["slot_tables"] = self.put_slot_tables(tables)
    bias = state_lib.expert_biases(self.model_cfg, rest)
    if bias is not None:
      state["expert_bias"] = jax.device_put(bias.astype(jnp.float32), self.replicated)
    return state, rest

  def put_slot_tables(self, tables_MxAxZ):
    """Slot tables [M, A, Z] as the state holds them (int32, replicated; the same on every process)."""
    return jax.device_put(np.asarray(tables_MxAxZ, np.int32), self.replicated)

  def targets(self, key, tokens_BxS):
    if self.model_cfg.causal:
      return objective.next_token(tokens_BxS, pad_id=self.tok.pad_id)
    return objective.bert_mask(
      key,
      tokens_BxS,
      mask_id=self.tok.mask_id,
      first_ordinary=self.tok.first_ordinary,
      num_ordinary=self.tok.num_ordinary,
      mask_prob=self.config.data.mask_prob,
    )

  def _step(self, state, rest, tokens_UxBxS):
    """One optimizer update from micro-batches tokens [U, B, S] -> (state, metrics)."""
    rest, heldout_KxBxS = rest if self.heldout else (rest, None)
    num_micro = tokens_UxBxS.shape[0]
    rng, step_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    mask_keys, model_keys = jnp.split(jax.random.split(step_key, 2 * num_micro), 2)
    inputs_UxBxS, positions_UxBxP, targets_UxBxP, weights_UxBxP = jax.vmap(self.targets)(mask_keys, tokens_UxBxS)
    total = jnp.maximum(jnp.sum(weights_UxBxP), 1.0)
    if "slot_tables" in state:
      rest = state_lib.with_slot_tables(self.model_cfg, rest, state["slot_tables"])
    if "expert_bias" in state:
      rest = state_lib.with_expert_biases(self.model_cfg, rest, state["expert_bias"])

    if self.pipeline is None:
      loss_fn = step_lib.micro_batch_loss(self, rest, total, num_micro)
      micro_batches = (inputs_UxBxS, positions_UxBxP, targets_UxBxP, weights_UxBxP, model_keys)
      counts = state_lib.balance_counts(self.model_cfg, rest)
      grads, loss_sums, corrects, auxes = step_lib.accumulated(loss_fn, state["params"], counts, micro_batches)
    else:  # the micro-batches through the pipeline's stages (`moejax.pipeline.decoder`), the same sums
      grads, loss_sums, corrects, auxes = self.pipeline.loss_and_grads(
        state["params"],
        rest,
        dict(
          inputs=inputs_UxBxS,
          targets=targets_UxBxP,
          weights=weights_UxBxP,
          key=model_keys,
          total=jnp.full((num_micro,), total),
        ),
      )
    params, opt_state = precision.apply(self.tx, grads, state["opt_state"], state["params"])
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": jax.random.key_data(rng)}
    if "slot_tables" in state:
      new_state["slot_tables"] = state["slot_tables"]
    learning_rate = self.learning_rate(state["step"])
    metrics = step_lib.metrics(grads, loss_sums, corrects, auxes, total, learning_rate, self.model_cfg)
    if "expert_bias" in state:  # from the whole step's loads (all micro-batches)
      new_state["expert_bias"] = step_lib.update_expert_bias(
        state["expert_bias"], metrics["expert_counts"], self.moe_cfg.bias_update_rate
      )
    # A non-finite loss or gradient norm (or a loss spike) leaves the parameters, optimizer state and biases as they were.
    new_state, metrics = guard_lib.kept_unless_applied(state, new_state, metrics, self.spike_factor)
    if heldout_KxBxS is not None:
      metrics["heldout_loss"] = self._heldout_loss(new_state, rest, heldout_KxBxS)
    if "expert_bias" in state:  # after this step's update: the range the next step routes with
      bias_MxE = new_state["expert_bias"]
      metrics["expert_bias_range"] = jnp.max(bias_MxE, axis=-1) - jnp.min(bias_MxE, axis=-1)
    return new_state, metrics

  def _heldout_loss(self, state, rest, tokens_KxBxS):
    """The held-out loss of `state` (the step's result: its parameters, slot tables and biases) where it is due,
    else NaN."""
    if "expert_bias" in state:
      rest = state_lib.with_expert_biases(self.model_cfg, rest, state["expert_bias"])
    model = lambda inputs_BxS, positions_BxP: nnx.merge(self.graphdef, state["params"], rest)(
      inputs_BxS, positions_BxP=positions_BxP, train=False
    )[0]
    return jax.lax.cond(
      heldout_lib.due(state["step"], self.config.log.eval_every, self.config.steps),
      lambda: heldout_lib.mean_loss(model, self.targets, tokens_KxBxS),
      lambda: jnp.float32(jnp.nan),
    )


def train(config: ml_collections.ConfigDict, workdir: str, checked=None) -> dict:
  """Trains (or resumes training in `workdir`) and returns the run's summary.

  checked: what `moejax.train.config.checked` returned for `config` when the caller checked it already (the
  config with its preset applied, the model and MoE layer configs); else it is checked here.
  Expects JAX's distributed runtime to be initialised already when there are several processes. Raises ConfigError
  for a workdir holding another program's outputs, `guard.TrainingStopped` after too many skipped steps in a row.
  """
  config, model_cfg, moe_cfg = checked or config_lib.checked(config)
  inputs_lib.check(config)
  leader = jax.process_index() == 0
  say = lambda *a: print(*a, flush=True) if leader else None
  for directory in {workdir, config.checkpoint.branch_dir} - {""}:  # never over an export's, a sweep's outputs
    workdir_guard.check(directory, workdir_guard.TRAINER)
  workdir, branched_from = resume_lib.prepare(config, workdir, say)  # a changed config refused, or branched
  os.makedirs(workdir, exist_ok=True)
  mesh = mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node, stages=pipeline_section.stages(config))
  platform = platform_lib.of_mesh(mesh)
  collective_lib.check(moe_cfg.collective, platform, field="moe.collective")
  files, tok = inputs_lib.files_and_tokenizer(config, workdir)
  say(
    f"mesh {dict(mesh.shape)} of {platform} devices on {jax.process_count()} process(es); "
    f"{len(files)} file(s); tokenizer with {tok.num_ids} ids"
  )
  heldout, baseline = inputs_lib.heldout(config, files, tok, say)
  retry = moe_cfg.buffer_factor is not None and config.on_overflow == "retry"  # needs the state before: not donated
  trainer = Trainer(config, model_cfg, moe_cfg, mesh, tok, donate=not retry, heldout=heldout is not None)
  ckpt = checkpoint_lib.Checkpointer(
    os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep, use_async=config.checkpoint.use_async
  )
  start, state, rest, data_states, resumed = loop_lib.start_state(trainer, ckpt, config.data.shards, say)
  if leader:
    resume_lib.record(config, workdir, start, branched_from)
  if heldout is not None:
    rest = (rest, jax.make_array_from_callback(heldout.shape, trainer.batch_sharding, lambda index: heldout[index]))
  say(f"parameters: {sum(x.size for x in jax.tree.leaves(state['params'])):,}")
  batches = inputs_lib.batches(config, files, tok, data_states)
  writer = _metric_writer(config, workdir, start, leader, baseline)
  run_start = time.perf_counter()
  try:
    compile_s, counts, retries = loop_lib.run(
      config, trainer, state, rest, start, batches, ckpt, writer, say, retry, resumed
    )
  finally:
    for resource in (batches, ckpt, writer):
      resource.close()
  return run_summary.write(
    workdir,
    tok,
    counts,
    batches.state(),
    leader,
    say,
    compile_s=compile_s,
    run_s=time.perf_counter() - run_start,
    resumed_from=start,
    overflow_retries=len(retries),
    buffer_factor=retries[-1][1] if retries else moe_cfg.buffer_factor,
    heldout_unigram_entropy=baseline,
  )


def _metric_writer(config, workdir: str, start: int, leader: bool, baseline) -> metrics_lib.MetricWriter:
  """The run's metrics from step `start` on (written by process 0 only); baseline: the held-out unigram entropy."""
  return metrics_lib.MetricWriter(
    workdir,
    start,
    tensorboard=config.log.tensorboard,
    enabled=leader,
    total_steps=config.steps,
    heldout_unigram_entropy=baseline,
  )


def train_unless_checkpointed(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Trains with the training fields of `config` (`moejax.train.config.training_config`) into `workdir`
  unless it holds a checkpoint already (a config for inference names the run its model comes from)."""
  checkpoints = os.path.join(workdir, "checkpoints")
  if not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
    train(config_lib.training_config(config), workdir)
