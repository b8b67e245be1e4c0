"""A Hugging Face config.json <-> (`DecoderConfig`, `MoEConfig`), for the families of `decoder_config.FAMILIES`.

`from_hf_config` reads every field the families' transformers code reads for the forward pass (routing included:
top-k, scores, norm_topk_prob, routed_scaling_factor, n_group / topk_group and the group score of topk_method) and
refuses what it cannot honour by name; `to_hf_config` writes what transformers' from_pretrained loads. Here the
fields every family shares; each family's own (`moejax.models.families`) come from its `Family`.
"""

import dataclasses

from moejax.models import families
from moejax.models.decoder_config import FAMILIES, DecoderConfig
from moejax.models.families.base import num_experts, rope_theta
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, prefixed, require


def _rope(hf: dict) -> tuple[float, tuple | None]:
  """(theta, scaling as sorted pairs or None) from transformers 5's rope_parameters or the older rope_theta and
  rope_scaling."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
  if scaling:
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type"))
  return rope_theta(hf), None if not scaling else tuple(sorted(scaling.items()))


def _supported_family(hf: dict) -> families.Family:
  """The family of a config.json's model_type; what its forward pass here cannot honour (biases, another activation)
  is refused by its config.json field before any config is built."""
  model_type = hf.get("model_type")
  if model_type in families.UNSUPPORTED:
    allowed = f"one of {FAMILIES}"
    message = f"{model_type}: {families.UNSUPPORTED[model_type]} (config field model_type; moejax loads {allowed})"
    raise ConfigError(message, "model_type", model_type, allowed)
  require(model_type in FAMILIES, "model_type", model_type, f"one of {FAMILIES}")
  family = families.get(model_type)
  require(
    not hf.get("attention_bias") or family.attention_bias,
    "attention_bias",
    hf.get("attention_bias"),
    f"false for {model_type} (its published checkpoints have no attention biases)",
  )
  require(not hf.get("mlp_bias"), "mlp_bias", hf.get("mlp_bias"), "false (SwiGLU FFNs without biases)")
  require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), "'silu' (SwiGLU)")
  return family


def _decoder_fields(hf: dict, family: families.Family, dtype: str, param_dtype: str) -> dict:
  """DecoderConfig's fields of a config.json (before the `model` overrides): the fields every family shares, then
  the family's own over them, as a family may read a shared field its own way."""
  layers = hf["num_hidden_layers"]
  theta, scaling = _rope(hf)
  window, sliding_layers = family.sliding(hf, layers)
  decoder = dict(
    family=hf.get("model_type"),
    vocab_size=hf["vocab_size"],
    num_layers=layers,
    d_model=hf["hidden_size"],
    d_ff=hf.get("intermediate_size"),  # a family without one (Solar Open) says its own
    num_heads=hf["num_attention_heads"],
    max_len=hf["max_position_embeddings"],
    moe_layers=family.moe_layers(hf, layers),
    rms_eps=hf.get("rms_norm_eps", 1e-6),
    rope_theta=theta,
    rope_scaling=scaling,
    partial_rotary_factor=float(
      (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    ),
    sliding_window=window,
    sliding_layers=sliding_layers,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    dtype=dtype,
    param_dtype=param_dtype,
  )
  decoder.update(family.decoder_fields(hf))  # a family may read a shared field its own way (MiniMax-M2's rotary_dim)
  return decoder


def _moe_fields(hf: dict, family: families.Family, cfg: DecoderConfig, dtype: str) -> dict:
  """MoEConfig's fields of a config.json (before the `moe` overrides): a dense model gets a placeholder, as every
  model carries a MoE layer config."""
  if cfg.num_moe_layers:  # the routed layer as the checkpoint routes, moejax's defaults for the rest
    fields = {
      **dict(
        gated=True,
        activation="silu",
        top_k=hf.get("num_experts_per_tok"),
        d_model=hf["hidden_size"],
        num_experts=num_experts(hf),
      ),
      **family.moe_fields(hf),
    }
  else:  # a placeholder: no layer reads it
    fields = dict(num_experts=1, top_k=1, d_model=hf["hidden_size"], d_ff=cfg.d_ff)
  fields["dtype"] = dtype
  return fields


def from_hf_config(
  hf: dict, *, dtype: str = "float32", param_dtype: str = "float32", moe: dict | None = None, model: dict | None = None
) -> tuple[DecoderConfig, MoEConfig]:
  """(decoder config, MoE layer config) of a config.json's dict; `moe` overrides MoEConfig fields (transport,
  schedule, ...), `model` DecoderConfig fields (fsdp, remat, tensor_parallel, grad_sync, scan_layers). Errors name the
  config.json field, or moe.<field> and model.<field>."""
  hf = _supported_family(hf).decoder_config(hf)  # a vision-language model's decoder: its text_config
  family = _supported_family(hf)
  decoder = _decoder_fields(hf, family, dtype, param_dtype)
  unknown = sorted(set(model or {}) - set(DecoderConfig.__dataclass_fields__))
  require(not unknown, "model", unknown, f"DecoderConfig fields: {sorted(DecoderConfig.__dataclass_fields__)}")
  cfg = prefixed("model.", DecoderConfig, **{**decoder, **(model or {})})
  fields = _moe_fields(hf, family, cfg, dtype)
  try:
    return cfg, MoEConfig.from_mapping({**fields, **(moe or {})}, prefix="moe.")
  except ConfigError as e:
    raise ConfigError(f"{e} (the checkpoint's routing with moe={moe})", e.field, e.value, e.allowed) from e


def exported(cfg: DecoderConfig) -> DecoderConfig:
  """The decoder as `to_hf` writes it: a family's own, or as the family it exports as (`Family.exports_as`: a
  vision-language model's decoder as its text-only class's)."""
  target = families.get(cfg.family).exports_as
  return cfg if target is None else dataclasses.replace(cfg, family=target)


def to_hf_config(cfg: DecoderConfig, moe_cfg: MoEConfig) -> dict:
  """The config.json dict of a decoder (float32 or bfloat16 as its parameters): the fields every family shares,
  then its family's (`Family.to_hf`, which refuses what the family's config.json cannot say) and its sliding
  window. A vision-language model's decoder: as its text-only class's (`exported`)."""
  cfg = exported(cfg)
  family = families.get(cfg.family)
  hf = dict(
    model_type=cfg.family,
    architectures=[family.architecture],
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=cfg.d_ff,
    num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    max_position_embeddings=cfg.max_len,
    rms_norm_eps=cfg.rms_eps,
    hidden_act="silu",
    tie_word_embeddings=cfg.tie_embeddings,
    dtype=cfg.param_dtype,
    rope_parameters={
      "rope_theta": cfg.rope_theta,
      **(cfg.scaling or {"rope_type": "default"}),
      **({"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1 else {}),
    },
  )
  if not family.hybrid:
    for name, got, want in (
      ("mixers", cfg.mixers and set(cfg.mixers), cfg.mixers and {"attention"}),
      ("gated_attention", cfg.gated_attention, False),
      ("norm_offset", cfg.norm_offset, False),
    ):
      require(got == want, name, getattr(cfg, name), f"{want!r}: {cfg.family}'s config.json cannot say otherwise")
  plain = {"v_head_dim": 0, "value_scale": 1.0, "sliding_overrides": None}  # MiMo-V2-Flash's GQA fields
  for name in [] if family.latent else sorted(set(plain) - set(family.attention_fields)):
    got, why = getattr(cfg, name), f"{plain[name]!r}: {cfg.family}'s config.json cannot say otherwise"
    require(got == plain[name], name, got, why)
  hf.update(family.to_hf(cfg, moe_cfg))
  if not family.hybrid:  # layer_types names the hybrid families' mixers, not windows
    hf.update(family.sliding_to_hf(cfg))
  return hf
