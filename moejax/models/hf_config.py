"""A Hugging Face config.json <-> (`DecoderConfig`, `MoEConfig`), for the families of `decoder_config.FAMILIES`.

`from_hf_config` reads every field the families' transformers code reads for the forward pass (routing included:
top-k, scores, norm_topk_prob, routed_scaling_factor, n_group / topk_group and the group score of topk_method) and
refuses what it cannot honour by name; `to_hf_config` writes what transformers' from_pretrained loads.
"""

from moejax.models.decoder_config import FAMILIES, DecoderConfig
from moejax.moe.config import MoEConfig
from moejax.validation import ConfigError, prefixed, require

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# DeepSeek-V3's loss-free balancing bias moves at the paper's 0.001 per step (Sec. 4.2) unless the caller says.
V3_BIAS_RATE = 0.001


def _rope(hf: dict) -> tuple[float, tuple | None]:
  """(theta, scaling as sorted pairs or None) from transformers 5's rope_parameters or the older rope_theta and
  rope_scaling."""
  params = dict(hf.get("rope_parameters") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
  if scaling:
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type"))
  return float(theta), None if not scaling else tuple(sorted(scaling.items()))


def _num_experts(hf: dict) -> int:
  """Routed experts: num_experts (Qwen), num_local_experts (Mixtral; Qwen3-MoE as transformers 5 saves it) or
  n_routed_experts (DeepSeek)."""
  return hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0


def _moe_layers(family: str, hf: dict, layers: int) -> tuple:
  if family in ("llama", "qwen3"):
    return (False,) * layers
  if family == "mixtral":
    return (True,) * layers
  if family.startswith("deepseek"):
    return tuple(i >= hf.get("first_k_dense_replace", 0) for i in range(layers))
  skip, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
  return tuple(i not in skip and _num_experts(hf) > 0 and (i + 1) % step == 0 for i in range(layers))


def _sliding(family: str, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
  if family == "mixtral":
    return hf.get("sliding_window"), None
  if hf.get("layer_types"):
    kinds = tuple(kind == "sliding_attention" for kind in hf["layer_types"])
    return (hf.get("sliding_window"), kinds) if any(kinds) else (None, None)
  if hf.get("use_sliding_window"):
    return hf["sliding_window"], tuple(i >= hf.get("max_window_layers", 0) for i in range(layers))
  return None, None


def _moe_fields(family: str, hf: dict) -> dict:
  """The MoEConfig fields of a family's routed layer (the checkpoint's routing; moejax's defaults for the rest)."""
  fields = dict(gated=True, activation="silu", top_k=hf.get("num_experts_per_tok"), d_model=hf["hidden_size"],
                num_experts=_num_experts(hf))
  if family == "mixtral":
    return {**fields, "d_ff": hf["intermediate_size"], "renormalize": True,
            "load_balance_coef": hf.get("router_aux_loss_coef", 0.001), "jitter": hf.get("router_jitter_noise", 0.0)}
  if family in ("qwen2_moe", "qwen3_moe"):
    fields.update(d_ff=hf["moe_intermediate_size"],
                  renormalize=bool(hf.get("norm_topk_prob", False)),
                  load_balance_coef=hf.get("router_aux_loss_coef", 0.001))
    if family == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
      fields.update(num_shared_experts=1, shared_d_ff=hf["shared_expert_intermediate_size"], shared_gate=True)
    return fields
  v3 = family == "deepseek_v3"
  method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
  groups = hf.get("n_group") if method in ("group_limited_greedy", "noaux_tc") else None
  scoring = hf.get("scoring_func", "sigmoid" if v3 else "softmax")
  require(scoring in ("softmax", "sigmoid"), "scoring_func", scoring, "'softmax' or 'sigmoid'")
  fields.update(d_ff=hf["moe_intermediate_size"], score=scoring,
                renormalize=bool(hf.get("norm_topk_prob", False)), routed_scaling=hf.get("routed_scaling_factor", 1.0),
                group_score="max" if method == "group_limited_greedy" else "top2_sum")
  if groups and groups > 1:
    fields.update(num_groups=groups, topk_groups=hf["topk_group"])
  if hf.get("n_shared_experts"):
    fields.update(num_shared_experts=hf["n_shared_experts"], shared_d_ff=hf["moe_intermediate_size"])
  if v3:  # sequence-wise balance loss and the loss-free bias, as V3 trains (Sec. 2.1.2, 4.2)
    fields.update(bias_update_rate=V3_BIAS_RATE, balance_loss="sequence", load_balance_coef=0.0001)
  else:
    fields.update(load_balance_coef=hf.get("aux_loss_alpha", 0.001))
  return fields


def from_hf_config(hf: dict, *, dtype: str = "float32", param_dtype: str = "float32", moe: dict | None = None,
                   model: dict | None = None) -> tuple[DecoderConfig, MoEConfig]:
  """(decoder config, MoE layer config) of a config.json's dict; `moe` overrides MoEConfig fields (transport,
  schedule, ...), `model` DecoderConfig fields (fsdp, remat, tensor_parallel, grad_sync). Errors name the
  config.json field, or moe.<field> and model.<field>."""
  family = hf.get("model_type")
  require(family in FAMILIES, "model_type", family, f"one of {FAMILIES}")
  require(not hf.get("attention_bias") or family in ("qwen3_moe", "qwen3", "llama"), "attention_bias",
          hf.get("attention_bias"), f"false for {family} (its published checkpoints have no attention biases)")
  require(not hf.get("mlp_bias"), "mlp_bias", hf.get("mlp_bias"), "false (SwiGLU FFNs without biases)")
  require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), "'silu' (SwiGLU)")
  layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  latent = family.startswith("deepseek")
  theta, scaling = _rope(hf)
  window, sliding_layers = _sliding(family, hf, layers)
  decoder = dict(
      family=family, vocab_size=hf["vocab_size"], num_layers=layers, d_model=hf["hidden_size"],
      d_ff=hf["intermediate_size"], num_heads=heads, num_kv_heads=heads if latent else hf.get("num_key_value_heads")
      or heads, head_dim=(hf.get("qk_rope_head_dim") if latent else hf.get("head_dim")) or hf["hidden_size"] // heads,
      max_len=hf["max_position_embeddings"], moe_layers=_moe_layers(family, hf, layers),
      rms_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
      rope_interleaved=latent and (family == "deepseek_v2" or hf.get("rope_interleave", True)),
      qkv_bias=hf.get("qkv_bias", True) if family == "qwen2_moe" else bool(hf.get("attention_bias")),
      out_bias=family != "qwen2_moe" and bool(hf.get("attention_bias")),
      qk_norm=family in ("qwen3_moe", "qwen3"), sliding_window=window, sliding_layers=sliding_layers,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype, param_dtype=param_dtype,
      num_mtp_layers=hf.get("num_nextn_predict_layers", 0) if family == "deepseek_v3" else 0)
  if latent:
    decoder.update({k: hf[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim")})
  unknown = sorted(set(model or {}) - set(DecoderConfig.__dataclass_fields__))
  require(not unknown, "model", unknown, f"DecoderConfig fields: {sorted(DecoderConfig.__dataclass_fields__)}")
  cfg = prefixed("model.", DecoderConfig, **{**decoder, **(model or {})})
  fields = (_moe_fields(family, hf) if cfg.num_moe_layers else
            dict(num_experts=1, top_k=1, d_model=hf["hidden_size"], d_ff=hf["intermediate_size"]))
  fields["dtype"] = dtype
  try:
    return cfg, MoEConfig.from_mapping({**fields, **(moe or {})}, prefix="moe.")
  except ConfigError as e:
    raise ConfigError(f"{e} (the checkpoint's routing with moe={moe})", e.field, e.value, e.allowed) from e


def to_hf_config(cfg: DecoderConfig, moe_cfg: MoEConfig) -> dict:
  """The config.json dict of a decoder (float32 or bfloat16 as its parameters)."""
  hf = dict(model_type=cfg.family, architectures=[ARCHITECTURES[cfg.family]], vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.rms_eps, hidden_act="silu",
            tie_word_embeddings=cfg.tie_embeddings, dtype=cfg.param_dtype,
            rope_parameters={"rope_theta": cfg.rope_theta, **(cfg.scaling or {"rope_type": "default"})})
  moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
  if moe_layers and not cfg.latent:  # Mixtral's and Qwen's routers: softmax top-k, nothing else
    for name, plain in (("num_groups", None), ("score", "softmax"), ("routed_scaling", 1.0),
                        ("num_shared_experts", 1 if cfg.family == "qwen2_moe" else 0)):
      require(getattr(moe_cfg, name) == plain, f"moe.{name}", getattr(moe_cfg, name),
              f"{plain!r}: {cfg.family}'s config.json cannot say otherwise")
  if cfg.family == "mixtral":
    require(len(moe_layers) == cfg.num_layers, "moe_layers", cfg.moe_layers, "all True (Mixtral has no dense layers)")
    require(not cfg.qkv_bias, "qkv_bias", cfg.qkv_bias, "False (Mixtral's attention has no biases)")
    hf.update(num_local_experts=moe_cfg.num_experts, num_experts_per_tok=moe_cfg.top_k, intermediate_size=moe_cfg.d_ff,
              sliding_window=cfg.sliding_window, router_aux_loss_coef=moe_cfg.alpha, router_jitter_noise=moe_cfg.jitter)
  elif cfg.family in ("qwen2_moe", "qwen3_moe"):
    hf.update(num_experts=moe_cfg.num_experts, num_experts_per_tok=moe_cfg.top_k, moe_intermediate_size=moe_cfg.d_ff,
              norm_topk_prob=moe_cfg.renormalize, decoder_sparse_step=1, router_aux_loss_coef=moe_cfg.alpha,
              mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe(i)])
    if cfg.family == "qwen2_moe":
      hf.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=moe_cfg.shared_width)
    else:
      hf["attention_bias"] = cfg.qkv_bias
  elif cfg.latent:
    first_moe = moe_layers[0] if moe_layers else cfg.num_layers
    require(moe_layers == list(range(first_moe, cfg.num_layers)), "moe_layers", cfg.moe_layers,
            f"dense layers first, then MoE layers ({cfg.family}'s first_k_dense_replace)")
    hf.update({k: getattr(cfg, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                            "v_head_dim")})
    groups = moe_cfg.num_groups or 1
    hf.update(n_routed_experts=moe_cfg.num_experts, num_experts_per_tok=moe_cfg.top_k, first_k_dense_replace=first_moe,
              moe_intermediate_size=moe_cfg.d_ff, n_shared_experts=moe_cfg.num_shared_experts,
              routed_scaling_factor=moe_cfg.routed_scaling, norm_topk_prob=moe_cfg.renormalize, n_group=groups,
              topk_group=moe_cfg.topk_groups if moe_cfg.num_groups else 1, scoring_func=moe_cfg.score)
    if cfg.family == "deepseek_v2":
      hf["topk_method"] = "group_limited_greedy" if moe_cfg.num_groups else "greedy"
    else:
      hf.update(topk_method="noaux_tc", rope_interleave=cfg.rope_interleaved, num_nextn_predict_layers=cfg.num_mtp_layers)
  else:
    hf["attention_bias"] = cfg.qkv_bias
  if cfg.sliding_window is not None and cfg.family != "mixtral":
    hf.update(sliding_window=cfg.sliding_window, layer_types=[
        "sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)])
  return hf
