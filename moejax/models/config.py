"""The language models' config: `ModelConfig` (SMILE's models), and the model and MoE layer configs read from a run
config's `mesh`, `model` and `moe` sections (`from_sections`; training and inference read them alike): a model
section with a `family` field is a decoder family's (`DecoderConfig`)."""

import dataclasses

import ml_collections

from moejax.cost import parm
from moejax.models.decoder_config import DecoderConfig
from moejax.models.parallelism import Parallelism
from moejax.moe.config import DTYPES, MoEConfig
from moejax.moe.routing import ROUTERS
from moejax.validation import ConfigError, check_against_mesh, is_int, prefixed, require

KINDS = ("bert", "gpt")
# MoEConfig fields taken from the model section, so a config's moe section leaves them out.
MOE_FROM_MODEL = ("d_model", "d_ff")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Parallelism):
  """kind: 'bert' (bidirectional encoder, post-LN, MLM head) or 'gpt' (causal decoder, pre-LN).

  vocab_size: V, rows of the (tied) embedding table. max_len: positions; sequences may be shorter.
  moe_every: FFN of block i is an MoE layer iff (i + 1) % moe_every == 0 (2: every other, as in
    SMILE); 0: no MoE layers. dtype: compute dtype ('float32' or 'bfloat16'); parameters stay fp32.
  embed_init_std: std of the normal initialisation of token and position embeddings (BERT: 0.02;
    LAMB moves each tensor by a fraction of its norm per step, so short runs start larger).
  The layout fields (tensor_parallel, grad_sync, fsdp, remat): `moejax.models.parallelism.Parallelism`.
  """

  TENSOR_PARALLEL_SIZES = ("num_heads", "d_ff")  # what tensor parallelism splits (`Parallelism.check_mesh`)

  kind: str
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  d_ff: int
  max_len: int
  dropout: float = 0.1
  moe_every: int = 2
  dtype: str = "float32"
  embed_init_std: float = 0.02

  def __post_init__(self):
    require(self.kind in KINDS, "kind", self.kind, f"one of {KINDS}")
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_len"):
      value = getattr(self, name)
      require(is_int(value), name, value, "a positive int")
    require(self.d_model % self.num_heads == 0, "num_heads", self.num_heads, f"a divisor of d_model={self.d_model}")
    require(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout", self.dropout, "in [0, 1)")
    require(
      isinstance(self.moe_every, int) and self.moe_every >= 0,
      "moe_every",
      self.moe_every,
      "an int >= 0 (0: no MoE layers)",
    )
    require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
    require(
      isinstance(self.embed_init_std, (int, float)) and self.embed_init_std > 0,
      "embed_init_std",
      self.embed_init_std,
      "> 0",
    )
    self.check_parallelism()

  @property
  def causal(self) -> bool:
    return self.kind == "gpt"

  def is_moe(self, i: int) -> bool:
    return self.moe_every > 0 and (i + 1) % self.moe_every == 0

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe(i) for i in range(self.num_layers))


def moe_block_indices(cfg: ModelConfig) -> list[int]:
  """The blocks whose FFN is an MoE layer, in order (MoE layer j is block moe_block_indices(cfg)[j])."""
  return [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


def check_fields(fields, known, prefix: str, required=None) -> None:
  """Rejects fields not in `known` and missing `required` ones (default: all known), by name."""
  unknown = sorted(set(fields) - set(known))
  missing = sorted(set(known if required is None else required) - set(fields))
  if unknown or missing:
    raise ConfigError(
      f"config fields: unknown {[prefix + u for u in unknown]}, missing "
      f"{[prefix + m for m in missing]}; expected {[prefix + k for k in known]}"
    )


def _decoder_from_sections(config: ml_collections.ConfigDict) -> tuple[DecoderConfig, dict]:
  """A decoder family's config from the model section (DecoderConfig's fields) and the moe section's fields, which
  take d_model from the model (the experts' d_ff is the moe section's own: a family's dense FFN is model.d_ff)."""
  fields = dataclasses.fields(DecoderConfig)
  check_fields(
    config.model, [f.name for f in fields], "model.", [f.name for f in fields if f.default is dataclasses.MISSING]
  )
  model = {k: tuple(v) if isinstance(v, list) else v for k, v in config.model.items()}
  try:
    model_cfg = DecoderConfig(**model)
  except ConfigError as e:
    require(e.field is None, "model." + str(e.field), e.value, e.allowed)
    raise
  require("d_model" not in config.moe, "moe.d_model", config.moe.get("d_model"), "unset: experts use model.d_model")
  return model_cfg, {**config.moe, "d_model": model_cfg.d_model}


def tokens_per_call(config: ml_collections.ConfigDict) -> int:
  """The tokens one layer call sees in a run config: a micro-batch, batch_size / micro_batches x seq_len."""
  return config.batch_size // config.micro_batches * config.seq_len


def from_sections(config: ml_collections.ConfigDict) -> tuple[ModelConfig | DecoderConfig, MoEConfig]:
  """(model config, MoE layer config) of a run config (its preset already applied, `moejax.models.presets.apply`):
  mesh.nodes and mesh.gpus_per_node, the model section, the moe section (less MOE_FROM_MODEL, which come from the
  model section), each checked against the mesh; moe.esp_schedule 'auto' resolved for the tokens one layer call
  sees (batch_size / micro_batches x seq_len; moe.expert_backend 'auto' is resolved where the mesh is made, by the
  Trainer). Errors name the field."""
  for name in ("nodes", "gpus_per_node"):
    require(is_int(config.mesh[name]), f"mesh.{name}", config.mesh[name], "a positive int")
  if "family" in config.model:
    model_cfg, moe_fields = _decoder_from_sections(config)
  else:
    fields = dataclasses.fields(ModelConfig)
    check_fields(
      config.model, [f.name for f in fields], "model.", [f.name for f in fields if f.default is dataclasses.MISSING]
    )
    try:
      model_cfg = ModelConfig(**config.model)
    except ConfigError as e:
      require(e.field is None, "model." + str(e.field), e.value, e.allowed)
      raise
    for name in MOE_FROM_MODEL:
      require(name not in config.moe, f"moe.{name}", config.moe.get(name), f"unset: experts use model.{name}")
    moe_fields = {**config.moe, **{name: getattr(model_cfg, name) for name in MOE_FROM_MODEL}}
  router = ROUTERS[moe_fields.get("routing", "topk")]
  if not router.chooses_nodes and moe_fields.get("num_nodes") is not None:
    # A routing that chooses no node reads no node count: a copy left from another mesh (mesh.nodes changed alone)
    # becomes the mesh's, in the config too, so that a run records the node count it had.
    moe_fields["num_nodes"] = config.moe.num_nodes = config.mesh.nodes
  moe_cfg = MoEConfig.from_mapping(moe_fields, prefix="moe.")
  if model_cfg.num_moe_layers:
    check_against_mesh(moe_cfg, config.mesh.nodes, config.mesh.gpus_per_node)  # errors name moe.* and mesh.*
  model_cfg.check_mesh(config.mesh.nodes, config.mesh.gpus_per_node)
  if is_int(config.batch_size) and is_int(config.micro_batches) and is_int(config.seq_len):
    # Parm's Algorithm 1 picks 'auto' here, for the tokens one layer call sees, never while tracing.
    tokens = tokens_per_call(config)
    moe_cfg = prefixed("moe.", parm.resolve_auto, moe_cfg, tokens, config.mesh.nodes, config.mesh.gpus_per_node)
  return model_cfg, moe_cfg
