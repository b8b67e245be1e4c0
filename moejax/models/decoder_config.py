"""`DecoderConfig`: the decoder families of today's MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) and
their dense sources (Llama, Qwen3), in the fields their checkpoints' config.json files set (`moejax.models.hf_config`
reads and writes those files)."""

import dataclasses
import functools

from moejax.models import families, mixer_fields, mup, nope, qk_norm
from moejax.models.parallelism import Parallelism
from moejax.validation import is_int, is_number, require

FAMILIES = tuple(families.REGISTRY)  # one module each in moejax/models/families/
LATENT_FAMILIES = tuple(name for name, family in families.REGISTRY.items() if family.latent)  # MLA
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "tokamax")  # `moejax.models.attention.resolve_impl`
QK_NORM_MODES = qk_norm.NAMES  # `moejax.models.qk_norm.MODES`
MIXERS = mixer_fields.MIXERS
# The attention fields a sliding-window layer may hold its own way (`DecoderConfig.sliding_overrides`).
SLIDING_FIELDS = ("num_kv_heads", "attention_sinks", "rope_theta", "partial_rotary_factor")


@dataclasses.dataclass(frozen=True)
class DecoderConfig(Parallelism):
  """A pre-norm causal decoder: embeddings, `num_layers` blocks (RMSNorm, token mixer (attention, or another of
  `mixers`), RMSNorm, FFN), RMSNorm, head.

  family: one of FAMILIES. d_model, d_ff: the hidden and the dense FFN's widths (the experts' is MoEConfig.d_ff).
  num_heads, num_kv_heads, head_dim: grouped-query attention (num_kv_heads divides num_heads). max_len: positions.
  rope_theta, rope_scaling: RoPE's base and a checkpoint's scaling as sorted (key, value) pairs (None: plain RoPE;
    YaRN for DeepSeek); rope_interleaved: the rotary part in interleaved pairs (DeepSeek) or halves;
    partial_rotary_factor: the fraction of a GQA head rotated, its first head_dim x factor dimensions (GLM-4.5: 0.5).
  qkv_bias: biases on q, k, v (Qwen2-MoE); out_bias: on the output projection too (attention_bias of Llama and
    Qwen3); qk_norm: RMSNorm of q and k, by qk_norm_mode (`moejax.models.qk_norm`): 'head' (each head's before RoPE,
    weights [head_dim]: Qwen3), 'projection' (all of q's heads at once and all of k's before RoPE, weights
    [num_heads x head_dim] and [num_kv_heads x head_dim]: OLMoE, MiniMax-M2) or 'head_after_rope' (each head's after
    RoPE: HunYuan); clip_qkv: q, k and v clipped to +-clip_qkv after the norm (OLMoE;
    None: not); attention_sinks: a learned logit per head in the softmax's denominator (`sinks [num_heads]`,
    gpt-oss; grouped-query attention).
  sliding_window: keys at most this far behind a query (Mixtral; None: all), in the layers of sliding_layers (None:
    every layer). sliding_overrides: (field, value) pairs, sorted, that the sliding-window layers hold their own
    way, of SLIDING_FIELDS (MiMo-V2-Flash: twice the kv heads, sinks, another RoPE theta; `at(layer)`).
  v_head_dim (grouped-query attention): the value heads' width when narrower than head_dim (0: head_dim;
    MiMo-V2-Flash's 128 under q and k of 192); value_scale: v multiplied by it (MiMo's attention_value_scale).
  chunked_attention: the window is chunks of sliding_window positions, not sliding (Llama 4); nope_layers: per layer,
    no RoPE and no QK-norm (Llama 4's NoPE layers), their queries tempered by attn_temperature (`moejax.models.nope`);
    nope_qk_norm: NoPE layers keep their QK-norm (EXAONE-MoE's global layers). post_norm: each block norms its
    sublayers' outputs before the residual add, not their inputs (OLMo 2's, FlexOlmo's blocks).
  embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling: Granite's muP scalars (`mup`).
  query_scaling: (original_max, beta): every layer's queries times 1 + beta log1p(floor(p / original_max)) (Mistral 4's).
  kv_lora_rank: None for grouped-query attention, else MLA (DeepSeek-V2/V3): keys and values from a [kv_lora_rank]
    latent, with the rotary part qk_rope_head_dim of the keys shared by the heads, queries through a
    [q_lora_rank] latent (None: one projection); qk_nope_head_dim + qk_rope_head_dim wide q and k, v_head_dim v.
  moe_layers: per layer, whether its FFN is the MoE layer (else the dense SwiGLU FFN of width d_ff).
  mixers: per layer, its token mixer, one of MIXERS (`moejax.models.token_mixers`); None: attention in every layer
    (the MTP modules' blocks always). 'gated_deltanet' (Qwen3-Next's linear attention layers) takes the
    linear_* fields: linear_num_key_heads of linear_key_head_dim, linear_num_value_heads of linear_value_head_dim,
    a causal convolution linear_conv_kernel wide; linear_split_projections: its input projections held apart as
    in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a (Qwen3.5-MoE's), not in_proj_qkvz and
    in_proj_ba grouped per key head (Qwen3-Next's): the same layer, its tensors laid out another way.
    'kimi_delta' (Kimi Linear's KDA, `moejax.models.kimi_delta_attention`): the same, key heads and widths as values'.
    'dsa' (DeepSeek sparse attention: MLA with a q latent) takes indexer, sorted (field, value) pairs of its
    lightning indexer's heads, head_dim, topk and rope_interleaved (`moejax.models.sparse_attention`);
    'dsa_shared' (GLM-5's) is 'dsa' without an indexer, reusing the last 'dsa' layer's choice (the first layer 'dsa').
    'deepseek_v4' (sliding, CSA or HCA attention per layer, in mHC blocks) takes deepseek_v4, sorted (field, JSON
    value) pairs of the config.json fields its attention and hyper-connections read (`moejax.models.hyper_block`).
  hash_layers: per layer, whether its MoE layer routes by a token id table (routing 'hash', DeepSeek-V4's tid2eid).
  gated_attention: q_proj emits per head [query | gate] (2 x head_dim) and the attention's output is multiplied by
    sigmoid(gate) before o_proj (Qwen3-Next). norm_offset: every block RMSNorm (the layer norms, QK-norm, the final
    norm) scales by 1 + weight, its weights zero-centred (Qwen3-Next's).
  num_mtp_layers: DeepSeek-V3's multi-token prediction modules (each predicts one more token ahead in training;
    mtp_loss_coef weighs their mean loss, V3's lambda).
  dtype: the compute dtype; param_dtype: the parameters' ('float32' or 'bfloat16').
  attention_impl: how attention runs (`moejax.models.attention.attend`, through `jax.nn.dot_product_attention`):
    'xla' (the scores materialised, any platform), 'cudnn' (cuDNN's fused flash attention: a CUDA GPU, bfloat16, head
    widths a multiple of 8 up to 256 from Hopper on), 'tokamax' (tokamax's kernels, where it is installed) or 'auto':
    'cudnn' where it takes the layer (a trial run on the device included), else 'xla'. Resolved when the model is
    built (`moejax.models.attention.resolve_impl`); an impossible choice is refused.
  The layout fields (tensor_parallel: heads and the dense FFN over 'gpu'; grad_sync, fsdp, remat):
    `moejax.models.parallelism.Parallelism`.
  """

  # What tensor parallelism splits over a node's GPUs (`Parallelism.check_mesh`): query and key/value heads, the
  # dense FFN.
  TENSOR_PARALLEL_SIZES = ("num_heads", "num_kv_heads", "d_ff")

  family: str
  vocab_size: int
  num_layers: int
  d_model: int
  d_ff: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_len: int
  moe_layers: tuple
  rms_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  rope_interleaved: bool = False
  partial_rotary_factor: float = 1.0
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: bool = False
  qk_norm_mode: str = "head"
  clip_qkv: float | None = None
  attention_sinks: bool = False
  sliding_window: int | None = None
  sliding_layers: tuple | None = None
  tie_embeddings: bool = False
  q_lora_rank: int | None = None
  kv_lora_rank: int | None = None
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  value_scale: float = 1.0
  sliding_overrides: tuple | None = None
  chunked_attention: bool = False
  nope_layers: tuple | None = None
  nope_qk_norm: bool = False
  post_norm: bool = False
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  attention_multiplier: float | None = None
  logits_scaling: float = 1.0
  attn_temperature: tuple | None = None
  query_scaling: tuple | None = None
  mixers: tuple | None = None
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 4
  linear_split_projections: bool = False
  indexer: tuple | None = None
  deepseek_v4: tuple | None = None
  hash_layers: tuple | None = None
  gated_attention: bool = False
  norm_offset: bool = False
  num_mtp_layers: int = 0
  mtp_loss_coef: float = 0.3
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"

  def __post_init__(self):
    self._check_sizes()
    self._check_attention()
    mixer_fields.check(self)
    require(is_int(self.num_mtp_layers, 0), "num_mtp_layers", self.num_mtp_layers, "an int >= 0")
    require(is_number(self.mtp_loss_coef) and self.mtp_loss_coef >= 0, "mtp_loss_coef", self.mtp_loss_coef, ">= 0")
    for name in ("dtype", "param_dtype"):
      require(getattr(self, name) in ("float32", "bfloat16"), name, getattr(self, name), "'float32' or 'bfloat16'")
    require(self.attention_impl in ATTENTION_IMPLS, "attention_impl", self.attention_impl, f"one of {ATTENTION_IMPLS}")
    self.check_parallelism()

  def _check_sizes(self) -> None:
    """The family, the widths and the per-layer tuples: first, as the later checks compute with them."""
    require(self.family in FAMILIES, "family", self.family, f"one of {FAMILIES}")
    for name in ("vocab_size", "num_layers", "d_model", "d_ff", "num_heads", "num_kv_heads", "head_dim", "max_len"):
      require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int")
    require(
      self.num_heads % self.num_kv_heads == 0,
      "num_kv_heads",
      self.num_kv_heads,
      f"a divisor of num_heads={self.num_heads}",
    )
    require(
      isinstance(self.moe_layers, tuple) and len(self.moe_layers) == self.num_layers,
      "moe_layers",
      self.moe_layers,
      f"a tuple of {self.num_layers} bools",
    )
    require(
      self.sliding_window is None or is_int(self.sliding_window),
      "sliding_window",
      self.sliding_window,
      "None or a positive int",
    )
    require(
      self.sliding_layers is None or len(self.sliding_layers) == self.num_layers,
      "sliding_layers",
      self.sliding_layers,
      f"None or a tuple of {self.num_layers} bools",
    )

  def _check_attention(self) -> None:
    """The attention's fields (MLA's widths, RoPE's rotated part, sinks, QK-norm, clipping): refused here by name,
    not as a shape error when the layers are built."""
    if self.latent:
      for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int (multi-head latent attention)")
      require(
        self.q_lora_rank is None or is_int(self.q_lora_rank), "q_lora_rank", self.q_lora_rank, "None or a positive int"
      )
    require(
      is_number(self.partial_rotary_factor)
      and 0 < self.partial_rotary_factor <= 1
      and (not self.latent or self.partial_rotary_factor == 1),
      "partial_rotary_factor",
      self.partial_rotary_factor,
      "in (0, 1] (1 with multi-head latent attention)",
    )
    require(
      self.qk_rope_head_dim % 2 == 0 and self.rope_dim % 2 == 0,
      "head_dim",
      self.head_dim,
      "even, and its rotated part head_dim x partial_rotary_factor too (RoPE rotates pairs)",
    )
    require(
      not (self.attention_sinks and self.latent),
      "attention_sinks",
      self.attention_sinks,
      "False with multi-head latent attention (gpt-oss's sinks are grouped-query attention's)",
    )
    require(self.qk_norm_mode in QK_NORM_MODES, "qk_norm_mode", self.qk_norm_mode, f"one of {QK_NORM_MODES}")
    require(
      self.clip_qkv is None or (is_number(self.clip_qkv) and self.clip_qkv > 0),
      "clip_qkv",
      self.clip_qkv,
      "None or a number > 0",
    )
    self._check_values_and_sliding()

  def _check_values_and_sliding(self) -> None:
    """GQA's narrower values (v_head_dim, value_scale) and the sliding layers' own fields (sliding_overrides)."""
    require(is_int(self.v_head_dim, 0), "v_head_dim", self.v_head_dim, "an int >= 0 (0: head_dim)")
    require(is_number(self.value_scale) and self.value_scale > 0, "value_scale", self.value_scale, "a number > 0")
    require(
      not self.gated_attention or self.value_dim == self.head_dim,
      "v_head_dim",
      self.v_head_dim,
      f"0 or head_dim={self.head_dim} with gated_attention (its gate is head_dim wide)",
    )
    nope.check(self)
    family = families.get(self.family)  # post-norm: the sequential block's norms after their sublayers
    ok = isinstance(self.post_norm, bool) and not (self.post_norm and not family.sequential)
    require(ok, "post_norm", self.post_norm, f"True or False; False for {self.family}'s {family.block} blocks")
    mup.check(self, family.sequential)
    overrides = self.sliding_overrides
    if overrides is not None:
      fields = isinstance(overrides, tuple) and {pair[0] for pair in overrides} <= set(SLIDING_FIELDS)
      allowed = f"None, or (field, value) pairs of {SLIDING_FIELDS} with a sliding window and no MLA"
      require(fields and self.sliding_window is not None and not self.latent, "sliding_overrides", overrides, allowed)
      for i in [i for i in range(self.num_layers) if self.window(i)][:1]:
        self.at(i)  # the sliding layers' fields, checked as a config of their own

  def at(self, layer: int) -> "DecoderConfig":
    """The config of layer `layer`'s attention: this one, or in a sliding-window layer with its sliding_overrides."""
    if not self.sliding_overrides or layer >= self.num_layers or not self.window(layer):
      return self
    return _with_overrides(self)

  def mixer(self, layer: int) -> str:
    """Layer `layer`'s token mixer (one of MIXERS); attention in the MTP modules' blocks (layers num_layers on)."""
    return "attention" if self.mixers is None or layer >= self.num_layers else self.mixers[layer]

  @property
  def latent(self) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3)."""
    return self.kv_lora_rank is not None

  @property
  def value_dim(self) -> int:
    """The width of a value head: v_head_dim, or head_dim where it is 0."""
    return self.v_head_dim or self.head_dim

  @property
  def rope_dim(self) -> int:
    """The rotated width of a head's q and k."""
    return self.qk_rope_head_dim if self.latent else int(self.head_dim * self.partial_rotary_factor)

  @property
  def scaling(self) -> dict | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  def window(self, layer: int) -> int | None:
    """The sliding window of layer `layer`, or None (full causal attention)."""
    slides = self.sliding_layers is None or self.sliding_layers[layer]
    return self.sliding_window if slides else None

  # The interface the trainer and inference share with the SMILE models (`ModelConfig`).
  causal = True

  def is_moe(self, i: int) -> bool:
    return bool(self.moe_layers[i])

  @property
  def num_moe_layers(self) -> int:
    return sum(map(bool, self.moe_layers))


@functools.cache
def _with_overrides(cfg: DecoderConfig) -> DecoderConfig:
  """The sliding layers' config of `cfg`: its sliding_overrides applied (and cleared), once per config."""
  return dataclasses.replace(cfg, **dict(cfg.sliding_overrides), sliding_overrides=None)
