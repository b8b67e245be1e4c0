"""Training SMILE's language models: config validation, sharded state, the train step, and `train`, which
sets up a run and hands it to `moejax.train.loop`.

One jitted step runs over the whole ('node', 'gpu') mesh: the batch is sharded over both axes,
dense parameters are replicated (data parallel) and experts are sharded by the MoE layer (expert
parallel); XLA inserts the gradient all-reduce. The step accumulates gradients over micro-batches
and adds the auxiliary losses of all MoE layers to the task loss (SMILE Eq. 5).
"""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import expert_sharding
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES
from moejax.train import checkpoint as checkpoint_lib
from moejax.train import data as data_lib
from moejax.train import loop as loop_lib
from moejax.train import metrics as metrics_lib
from moejax.train import model as model_lib
from moejax.train import objective, optim, presets
from moejax.train import tokenizer as tokenizer_lib
from moejax.train.model import ModelConfig
from moejax.validation import ConfigError, is_int, require

SECTIONS = {
    "mesh": ("nodes", "gpus_per_node"),
    "data": data_lib.CONFIG_FIELDS,
    "optim": optim.CONFIG_FIELDS,
    "checkpoint": checkpoint_lib.CONFIG_FIELDS,
    "log": metrics_lib.CONFIG_FIELDS,
}
TOP_LEVEL = ("seed", "steps", "batch_size", "micro_batches", "seq_len", "on_overflow", "mesh", "model", "moe",
             "data", "optim", "checkpoint", "log", *presets.CONFIG_FIELDS)
REQUIRED = tuple(name for name in TOP_LEVEL if name not in presets.CONFIG_FIELDS)  # a preset is optional
OVERFLOW_POLICIES = ("retry", "drop")
# MoEConfig fields the trainer takes from the model section, so a config's moe section leaves them out.
MOE_FROM_MODEL = ("d_model", "d_ff")


def _check_fields(fields, known, prefix: str, required=None) -> None:
  """Rejects fields not in `known` and missing `required` ones (default: all known), by name."""
  unknown = sorted(set(fields) - set(known))
  missing = sorted(set(known if required is None else required) - set(fields))
  if unknown or missing:
    raise ConfigError(f"config fields: unknown {[prefix + u for u in unknown]}, missing "
                      f"{[prefix + m for m in missing]}; expected {[prefix + k for k in known]}")


def validate(config: ml_collections.ConfigDict) -> tuple[ModelConfig, MoEConfig]:
  """Every check that needs no devices, before anything is compiled; errors name the field, its
  value and what is allowed. The data, optim, checkpoint and log sections are checked by the
  `validate_config` of the module that uses them. A config naming a preset (top-level `preset`) is
  checked with the preset applied (`moejax.train.presets.apply`). Returns the model and MoE layer configs."""
  _check_fields(config, TOP_LEVEL, "", REQUIRED)
  config = presets.apply(config)
  for section, known in SECTIONS.items():
    _check_fields(config[section], known, section + ".")
  for name in ("nodes", "gpus_per_node"):
    require(is_int(config.mesh[name]), f"mesh.{name}", config.mesh[name], "a positive int")
  devices = config.mesh.nodes * config.mesh.gpus_per_node
  fields = dataclasses.fields(ModelConfig)
  _check_fields(config.model, [f.name for f in fields], "model.",
                [f.name for f in fields if f.default is dataclasses.MISSING])
  try:
    model_cfg = ModelConfig(**config.model)
  except ConfigError as e:
    require(e.field is None, "model." + str(e.field), e.value, e.allowed)
    raise
  for name in MOE_FROM_MODEL:
    require(name not in config.moe, f"moe.{name}", config.moe.get(name), f"unset: experts use model.{name}")
  moe_fields = {**config.moe, **{name: getattr(model_cfg, name) for name in MOE_FROM_MODEL}}
  moe_cfg = MoEConfig.from_mapping(moe_fields, prefix="moe.")
  if model_cfg.num_moe_layers:
    moe_cfg.check_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  model_cfg.check_mesh(config.mesh.gpus_per_node)
  if is_int(config.batch_size) and is_int(config.micro_batches) and is_int(config.seq_len):
    # Parm's Algorithm 1 picks 'auto' here, for the tokens one layer call sees, never while tracing.
    tokens = config.batch_size // config.micro_batches * config.seq_len
    moe_cfg = expert_sharding.resolve_auto(moe_cfg, tokens, config.mesh.nodes, config.mesh.gpus_per_node)

  require(is_int(config.seed, 0), "seed", config.seed, "an int >= 0")
  require(is_int(config.steps), "steps", config.steps, "a positive int")
  require(is_int(config.seq_len, 2) and config.seq_len <= model_cfg.max_len, "seq_len", config.seq_len,
          f"an int in [2, model.max_len={model_cfg.max_len}]")
  require(config.on_overflow in OVERFLOW_POLICIES, "on_overflow", config.on_overflow, f"one of {OVERFLOW_POLICIES}")
  require(is_int(config.micro_batches), "micro_batches", config.micro_batches, "a positive int")
  require(is_int(config.batch_size) and config.batch_size % config.micro_batches == 0, "batch_size",
          config.batch_size, f"a positive multiple of micro_batches={config.micro_batches}")
  rows = config.batch_size // config.micro_batches
  require(rows % devices == 0, "batch_size", config.batch_size,
          f"a multiple of micro_batches x the mesh's devices = {config.micro_batches * devices}")

  data_lib.validate_config(config.data, prefix="data.", rows=rows)
  optim.validate_config(config.optim, prefix="optim.")
  checkpoint_lib.validate_config(config.checkpoint, prefix="checkpoint.")
  metrics_lib.validate_config(config.log, prefix="log.")
  return model_cfg, moe_cfg


def load_tokenizer(config, files: list[str], cache_dir: str) -> tokenizer_lib.Tokenizer:
  """The configured tokenizer, or one trained on the first `tokenizer_train_chars` of the corpus."""

  def texts():
    chars = 0
    for text in data_lib.texts(files):
      yield from (line for line in text.split("\n") if line.strip())
      chars += len(text)
      if chars >= config.data.tokenizer_train_chars:
        return

  key = json.dumps([[(os.path.basename(f), os.path.getsize(f)) for f in files],
                    config.data.tokenizer_train_chars])
  tok = tokenizer_lib.load_or_train(config.data.tokenizer_model, cache_dir, config.model.vocab_size, key, texts)
  require(tok.num_ids <= config.model.vocab_size, "model.vocab_size", config.model.vocab_size,
          f"at least the tokenizer's {tok.num_ids} ids")
  return tok


class Trainer:
  """The model's functional pieces on `mesh`: sharded state init, the jitted train step.

  Of `config` it reads seed, steps, optim and data.mask_prob; `tok` supplies the special ids.

  state: {'params', 'opt_state', 'step' (int32), 'rng' (uint32 key data)}, and with replication
(moe.slots_per_device) 'slot_tables' [M, A, Z] int32, the MoE layers' slot tables: not optimised,
replicated, checkpointed with the rest, written into each layer's `SlotTable` in `rest` by the step
and re-planned between steps by the loop (same shape, so the compiled step is reused); with
auxiliary-loss-free balancing (moe.bias_update_rate = u > 0) 'expert_bias' [M, E] float32, the MoE
layers' balancing biases (DeepSeek-V3 Sec. 2.1.2): not optimised (no gradient reaches them), replicated,
checkpointed with the rest, written into each layer's `ExpertBias` in `rest` by the step and updated at
the end of the step from the step's expert loads (`update_expert_bias`). Every array is placed by
`state_shardings`, declared once here together with the batch sharding.
  """

  def __init__(self, config, model_cfg: ModelConfig, moe_cfg: MoEConfig, mesh,
               tok: tokenizer_lib.Tokenizer | objective.TokenIds, *, donate: bool = True):
    self.config, self.model_cfg, self.moe_cfg, self.mesh, self.tok = config, model_cfg, moe_cfg, mesh, tok
    self.donate = donate
    self.graphdef, abstract_params, abstract_rest = model_lib.abstract_state(model_cfg, moe_cfg, mesh, config.seed)
    sharding_of = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    param_shardings = sharding_of(abstract_params)
    o = config.optim
    self.learning_rate = optim.warmup_then_decay(o.learning_rate, o.warmup_steps, o.decay_steps or config.steps,
                                                 o.decay, o.end_fraction)
    per_expert = jax.tree.map(lambda s: s.spec != P(), param_shardings)
    self.tx = optim.lamb(self.learning_rate, per_expert, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                         clip_norm=o.clip_norm)
    self.replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt, param_shardings,
                                          transform_non_params=lambda _: self.replicated)
    self.state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": self.replicated,
                            "rng": self.replicated}
    abstract_tables = model_lib.slot_tables(model_cfg, abstract_rest)
    if abstract_tables is not None:
      self.state_shardings["slot_tables"] = self.replicated
    abstract_bias = model_lib.expert_biases(model_cfg, abstract_rest)
    if abstract_bias is not None:
      self.state_shardings["expert_bias"] = self.replicated
    self.rest_shardings = sharding_of(abstract_rest)
    self.batch_sharding = NamedSharding(mesh, P(None, AXES))  # tokens [micro_batches, rows, seq_len]

    def complete(params):
      return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
              "rng": jax.random.key_data(jax.random.key(config.seed + 1))}

    self._complete = jax.jit(complete, out_shardings={k: v for k, v in self.state_shardings.items()
                                                      if k not in ("slot_tables", "expert_bias")})
    abstract_state = jax.eval_shape(complete, abstract_params)
    if abstract_tables is not None:
      abstract_state["slot_tables"] = abstract_tables
    if abstract_bias is not None:
      abstract_state["expert_bias"] = abstract_bias
    self.abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                       abstract_state, self.state_shardings)
    self.step = jax.jit(self._step, in_shardings=(self.state_shardings, self.rest_shardings, self.batch_sharding),
                        out_shardings=(self.state_shardings, self.replicated), donate_argnums=0 if donate else ())

  def with_moe(self, moe_cfg: MoEConfig) -> "Trainer":
    """The same trainer with another MoE layer config (same parameters and state layout)."""
    return Trainer(self.config, self.model_cfg, moe_cfg, self.mesh, self.tok, donate=self.donate)

  def init(self):
    """(state, rest): fresh sharded state, and the model's non-parameter state (constant; the step
    takes the slot tables from the state)."""
    params, rest = model_lib.init_state(self.model_cfg, self.moe_cfg, self.mesh, self.config.seed)
    state = self._complete(params)
    tables = model_lib.slot_tables(self.model_cfg, rest)
    if tables is not None:
      state["slot_tables"] = self.put_slot_tables(tables)
    bias = model_lib.expert_biases(self.model_cfg, rest)
    if bias is not None:
      state["expert_bias"] = jax.device_put(bias.astype(jnp.float32), self.replicated)
    return state, rest

  @property
  def holders(self) -> tuple[int, int]:
    """(nodes, holders per node) of a slot table's rows: the devices, or the nodes with esp_schedule."""
    nodes, gpus = mesh_lib.axis_sizes(self.mesh)
    return (nodes, 1) if self.moe_cfg.esp_schedule is not None else (nodes, gpus)

  def put_slot_tables(self, tables_MxAxZ):
    """Slot tables [M, A, Z] as the state holds them (int32, replicated; the same on every process)."""
    return jax.device_put(np.asarray(tables_MxAxZ, np.int32), self.replicated)

  def targets(self, key, tokens_BxS):
    if self.model_cfg.kind == "gpt":
      return objective.next_token(tokens_BxS, pad_id=self.tok.pad_id)
    return objective.bert_mask(key, tokens_BxS, mask_id=self.tok.mask_id, first_ordinary=self.tok.first_ordinary,
                               num_ordinary=self.tok.num_ordinary, mask_prob=self.config.data.mask_prob)

  def _step(self, state, rest, tokens_UxBxS):
    """One optimizer update from micro-batches tokens [A, B, S] -> (state, metrics)."""
    num_micro = tokens_UxBxS.shape[0]
    rng, step_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
    mask_keys, model_keys = jnp.split(jax.random.split(step_key, 2 * num_micro), 2)
    inputs_UxBxS, positions_UxBxP, targets_UxBxP, weights_UxBxP = jax.vmap(self.targets)(mask_keys, tokens_UxBxS)
    total = jnp.maximum(jnp.sum(weights_UxBxP), 1.0)

    if "slot_tables" in state:
      rest = model_lib.with_slot_tables(self.model_cfg, rest, state["slot_tables"])
    if "expert_bias" in state:
      rest = model_lib.with_expert_biases(self.model_cfg, rest, state["expert_bias"])

    def loss_fn(params, earlier_counts, inputs_BxS, positions_BxP, targets_BxP, weights_BxP, key):
      micro_rest = rest
      if earlier_counts is not None:
        micro_rest = model_lib.with_balance_counts(self.model_cfg, rest, earlier_counts)
      model = nnx.merge(self.graphdef, params, micro_rest)
      dropout_key, jitter_key = jax.random.split(key)
      logits_BxPxV, aux = model(inputs_BxS, positions_BxP=positions_BxP, train=True,
                                rngs=nnx.Rngs(dropout=dropout_key, jitter=jitter_key))
      loss_sum, correct = objective.cross_entropy_sums(logits_BxPxV, targets_BxP, weights_BxP)
      return loss_sum / total + aux["aux_loss"] / num_micro, (loss_sum, correct, aux)

    def micro_step(carry, micro):
      # balance_loss='global_batch': each micro-batch's loss sees the choice counts of the step's earlier ones
      # (the layers return them plus their own: the next micro-batch's input).
      grads, earlier_counts = carry
      (_, (loss_sum, correct, aux)), g = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], earlier_counts,
                                                                                 *micro)
      earlier_counts = aux.pop("balance_counts", None)
      return (jax.tree.map(jnp.add, grads, g), earlier_counts), (loss_sum, correct, aux)

    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    counts = model_lib.balance_counts(self.model_cfg, rest)
    (grads, _), (loss_sums, corrects, auxes) = jax.lax.scan(
        micro_step, (zeros, None if counts is None else jnp.zeros_like(counts)),
        (inputs_UxBxS, positions_UxBxP, targets_UxBxP, weights_UxBxP, model_keys))
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                 "step": state["step"] + 1, "rng": jax.random.key_data(rng)}
    if "slot_tables" in state:
      new_state["slot_tables"] = state["slot_tables"]
    counts_MxE = jnp.sum(auxes["expert_counts"], axis=0)  # the whole step's loads (all micro-batches)
    if "expert_bias" in state:
      new_state["expert_bias"] = update_expert_bias(state["expert_bias"], counts_MxE,
                                                    self.moe_cfg.bias_update_rate)
    task_loss, aux_loss = jnp.sum(loss_sums) / total, jnp.mean(auxes["aux_loss"])
    metrics = {"loss": task_loss + aux_loss, "task_loss": task_loss, "accuracy": jnp.sum(corrects) / total,
               "aux_loss": aux_loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": self.learning_rate(state["step"]),
               "expert_counts": counts_MxE,
               "tokens_dropped": jnp.sum(auxes["tokens_dropped"], axis=0),
               "tokens_overflowed": jnp.sum(auxes["tokens_overflowed"], axis=0)}
    if "expert_bias" in state:  # after this step's update: the range the next step routes with
      metrics["expert_bias_range"] = jnp.max(new_state["expert_bias"], axis=-1) - jnp.min(new_state["expert_bias"],
                                                                                            axis=-1)
    return new_state, metrics


def update_expert_bias(bias_MxE: jax.Array, counts_MxE: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's auxiliary-loss-free balancing update (Sec. 2.1.2), per MoE layer: b_e += u * sign(mean
  load - load_e), from one step's token-choices per expert counts [M, E]; an overloaded expert's bias
  falls, an underloaded one's rises, one equal to the mean keeps its bias. float32 like the bias."""
  load_MxE = counts_MxE.astype(jnp.float32)
  mean_Mx1 = jnp.mean(load_MxE, axis=-1, keepdims=True)
  return bias_MxE + jnp.float32(rate) * jnp.sign(mean_Mx1 - load_MxE)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes training in `workdir`) and returns the run's summary.

  Expects JAX's distributed runtime to be initialised already when there are several processes.
  """
  config = presets.apply(config)
  model_cfg, moe_cfg = validate(config)
  leader = jax.process_index() == 0
  say = lambda *a: print(*a, flush=True) if leader else None
  require(config.data.shards % jax.process_count() == 0, "data.shards", config.data.shards,
          f"a multiple of the job's {jax.process_count()} processes")
  os.makedirs(workdir, exist_ok=True)
  mesh = mesh_lib.make_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  platform = platform_lib.of_mesh(mesh)
  platform_lib.check_transport(moe_cfg.transport, platform, field="moe.transport")
  cache_dir = config.data.cache_dir or os.path.join(workdir, "cache")
  files = data_lib.corpus_files(config.data.train_files, cache_dir)
  tok = load_tokenizer(config, files, cache_dir)
  say(f"mesh {dict(mesh.shape)} of {platform} devices on {jax.process_count()} process(es); "
      f"{len(files)} file(s); tokenizer with {tok.num_ids} ids")
  retry = moe_cfg.buffer_factor is not None and config.on_overflow == "retry"
  trainer = Trainer(config, model_cfg, moe_cfg, mesh, tok, donate=not retry)  # a retry needs the state before
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                     use_async=config.checkpoint.use_async)
  state, rest = trainer.init()
  start, data_states, replan_window = 0, None, []
  restored = ckpt.restore_latest(trainer.abstract_state)
  if restored is not None:
    start, state, saved = restored
    data_states, replan_window = loop_lib.restored_host_state(saved, config.data.shards)
    say(f"resuming after step {start}")
  say(f"parameters: {sum(x.size for x in jax.tree.leaves(state['params'])):,}")
  rows = config.batch_size // config.micro_batches
  batches = data_lib.Batches(files, tok, seq_len=config.seq_len, rows=rows, micro_batches=config.micro_batches,
                             num_shards=config.data.shards, process_index=jax.process_index(),
                             process_count=jax.process_count(), states=data_states, prefetch=config.data.prefetch)
  writer = metrics_lib.MetricWriter(workdir, start, tensorboard=config.log.tensorboard, enabled=leader)
  run_start = time.perf_counter()
  try:
    compile_s, counts, retries = loop_lib.run(config, trainer, state, rest, start, batches, ckpt, writer, say, retry,
                                               replan_window)
  finally:
    batches.close()
    ckpt.close()
    writer.close()

  if jax.process_count() > 1:
    counts = np.asarray(multihost_utils.process_allgather(counts.astype(np.float32))).sum(axis=0)
  ordinary = counts[tok.first_ordinary:tok.first_ordinary + tok.num_ordinary]
  data_state = loop_lib.gather_data_state(batches.state())
  summary = metrics_lib.summarize(
      metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if leader else [],
      compile_s=compile_s, run_s=time.perf_counter() - run_start, resumed_from=start,
      overflow_retries=len(retries), buffer_factor=retries[-1][1] if retries else moe_cfg.buffer_factor,
      unigram_entropy=metrics_lib.unigram_entropy(ordinary) if ordinary.sum() else None,
      log_vocab=float(np.log(tok.num_ids)),
      documents=int(sum(s[data_lib.STATE_FIELDS.index("documents")] for s in data_state)),
      malformed_lines=int(sum(s[data_lib.STATE_FIELDS.index("malformed")] for s in data_state)))
  if leader:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    say(metrics_lib.format_summary(summary))
  logging.info("training finished: %s", summary)
  return summary
