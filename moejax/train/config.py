"""A training run's config: its sections and fields, and `checked`, every check that needs no devices, run once
per run before anything is compiled."""

import os

import ml_collections

from moejax import checkpoint as checkpoint_lib
from moejax.data import corpus as corpus_lib
from moejax.models import lm_loss, presets
from moejax.models.config import ModelConfig, check_fields, from_sections
from moejax.models.decoder_config import DecoderConfig
from moejax.moe.config import MoEConfig
from moejax.pipeline import section as pipeline_section
from moejax.train import guard, optim
from moejax.train import metrics as metrics_lib
from moejax.validation import is_int, reject_unknown, require

SECTIONS = {
  "mesh": ("nodes", "gpus_per_node"),
  "data": corpus_lib.CONFIG_FIELDS,
  "optim": optim.CONFIG_FIELDS,
  "checkpoint": checkpoint_lib.CONFIG_FIELDS,
  "log": metrics_lib.CONFIG_FIELDS,
}
# loss_chunk: vocabulary columns per chunk of the loss (`lm_loss.head_cross_entropy_sums`; absent: LOSS_CHUNK).
# pipeline: pipeline parallelism (`moejax.pipeline.section`; absent: none).
# train: the steps skipped and when to stop (`moejax.train.guard`; absent: its DEFAULTS).
OPTIONAL = ("init_from", "loss_chunk", "pipeline", "train", *presets.CONFIG_FIELDS)
TOP_LEVEL = (
  "seed",
  "steps",
  "batch_size",
  "micro_batches",
  "seq_len",
  "on_overflow",
  "mesh",
  "model",
  "moe",
  "data",
  "optim",
  "checkpoint",
  "log",
  *OPTIONAL,
)
OPTIONAL_SECTIONS = {"pipeline": pipeline_section.CONFIG_FIELDS, "train": guard.CONFIG_FIELDS}
REQUIRED = tuple(name for name in TOP_LEVEL if name not in OPTIONAL)
OVERFLOW_POLICIES = ("retry", "drop")


def training_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The training fields of a config that may hold other sections (e.g. 'generate')."""
  return ml_collections.ConfigDict({k: v for k, v in config.items() if k in TOP_LEVEL})


def checked_sections(config):
  """The config with its preset applied, after every section's unknown and mistyped fields are refused."""
  reject_unknown(config, TOP_LEVEL)  # one line: each unknown field's nearest known ones
  check_fields(config, TOP_LEVEL, "", REQUIRED)
  config = presets.apply(config)
  for section, known in SECTIONS.items():
    reject_unknown(config[section], known, section + ".")
    check_fields(config[section], known, section + ".")
  for section, known in OPTIONAL_SECTIONS.items():
    if config.get(section) is not None:
      reject_unknown(config[section], known, section + ".")
      check_fields(config[section], known, section + ".")
  return config


def check_run_fields(config, model_cfg) -> None:
  """The run's own scalars: seed, steps, seq_len, the loss's chunk, the overflow policy and the batch's split."""
  require(is_int(config.seed, 0), "seed", config.seed, "an int >= 0")
  require(is_int(config.steps), "steps", config.steps, "a positive int")
  require(
    is_int(config.seq_len, 2) and config.seq_len <= model_cfg.max_len,
    "seq_len",
    config.seq_len,
    f"an int in [2, model.max_len={model_cfg.max_len}]",
  )
  loss_chunk = config.get("loss_chunk", lm_loss.LOSS_CHUNK)
  require(
    is_int(loss_chunk, 0),
    "loss_chunk",
    loss_chunk,
    "an int >= 0 (vocabulary columns per chunk of the loss; 0: the logits at once)",
  )
  require(config.on_overflow in OVERFLOW_POLICIES, "on_overflow", config.on_overflow, f"one of {OVERFLOW_POLICIES}")
  require(is_int(config.micro_batches), "micro_batches", config.micro_batches, "a positive int")
  require(
    is_int(config.batch_size) and config.batch_size % config.micro_batches == 0,
    "batch_size",
    config.batch_size,
    f"a positive multiple of micro_batches={config.micro_batches}",
  )
  rows = config.batch_size // config.micro_batches
  devices = config.mesh.nodes * config.mesh.gpus_per_node
  require(
    rows % devices == 0,
    "batch_size",
    config.batch_size,
    f"a multiple of micro_batches x the mesh's devices = {config.micro_batches * devices}",
  )


def check_init_from(config, model_cfg) -> None:
  """A checkpoint to start from: a local Hugging Face directory, a decoder family's model, its own tokenizer."""
  init_from = config.get("init_from") or ""
  require(
    isinstance(init_from, str) and (not init_from or os.path.isfile(os.path.join(init_from, "config.json"))),
    "init_from",
    init_from,
    "'' or a local Hugging Face checkpoint directory (with config.json)",
  )
  require(
    not init_from or isinstance(model_cfg, DecoderConfig),
    "init_from",
    init_from,
    "'' unless the model section is a decoder family (configs/decoder.py:hf=PATH makes one from the checkpoint)",
  )
  # A tokenizer trained here would give ids the checkpoint's embeddings never saw.
  require(
    not init_from or config.data.tokenizer_model,
    "data.tokenizer_model",
    config.data.tokenizer_model,
    f"the checkpoint's tokenizer (a tokenizer.json or SentencePiece model): {init_from} has no tokenizer.json, "
    "and a tokenizer trained on the corpus would not match its embeddings",
  )


def checked(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, ModelConfig, MoEConfig]:
  """(config with its preset applied, model config, MoE layer config): every check that needs no devices,
  before anything is compiled; errors name the field, its value and what is allowed. The model, moe and mesh
  sections are read by `moejax.models.config.from_sections`; the data, optim, checkpoint and log sections are
  checked by the `validate_config` of the module that uses them. A config naming a preset (top-level `preset`)
  is checked with the preset applied (`moejax.models.presets.apply`)."""
  config = checked_sections(config)
  model_cfg, moe_cfg = from_sections(config)
  check_run_fields(config, model_cfg)
  check_init_from(config, model_cfg)
  rows = config.batch_size // config.micro_batches
  corpus_lib.validate_config(config.data, prefix="data.", rows=rows)
  optim.validate_config(config.optim, prefix="optim.")
  checkpoint_lib.validate_config(config.checkpoint, prefix="checkpoint.")
  metrics_lib.validate_config(config.log, prefix="log.")
  guard.validate_config(config.get("train") or {}, prefix="train.")
  pipeline_section.check(config, model_cfg, moe_cfg)
  return config, model_cfg, moe_cfg


def validate(config: ml_collections.ConfigDict) -> tuple[ModelConfig, MoEConfig]:
  """The model and MoE layer configs of a training config, after every check (`checked`)."""
  return checked(config)[1:]
