"""Llama 4 (`llama4_text`, transformers' Llama4ForCausalLM; `llama4`, Llama4ForConditionalGeneration, as Meta publishes
Llama 4 Scout and Maverick: a vision tower and projector before the decoder, run here on text-only input,
`vision_language`).

  attention  GQA; RoPE layers (no_rope_layers[i] = 1; by default all but every no_rope_layer_interval-th) rotate q and k
             in interleaved pairs (llama3-scaled frequencies as published), L2-norm them without weights (use_qk_norm:
             qk_norm_mode 'l2') and attend within chunks of attention_chunk_size positions (layer_types
             chunked_attention: `DecoderConfig.chunked_attention`); NoPE layers do neither and temper their queries
             (attn_temperature_tuning, floor_scale, attn_scale: `moejax.models.nope`)
  FFN        MoE layers by moe_layers (default every interleave_moe_layer_step-th), dense SwiGLU of intermediate_size_mlp
             elsewhere; the router (`feed_forward.router`) takes the top k of its logits, each weighted by
             sigmoid(logit), and the weight scales the expert's INPUT (`MoEConfig.weight_inputs`); one shared expert
             of intermediate_size (`feed_forward.shared_expert`) added unscaled
  experts    stacked as published: `feed_forward.experts.gate_up_proj` [E, d, 2f] (the gate projections, then the up
             ones: `hf_parts.block`), `down_proj` [E, f, d], as moejax holds them ([E, in, out])

Llama4TextConfig's defaults where config.json is silent (`DEFAULTS`). The published checkpoint names the decoder's
tensors `language_model.model.*` and `language_model.lm_head.weight`, the vision tower's `vision_model.*` and the
projector's `multi_modal_projector.*` (ignored); `to_hf` writes the decoder as `llama4_text`.
"""

import dataclasses

from moejax.models import hf_parts, qk_norm
from moejax.models.families import vision_language
from moejax.models.families.base import Family, moe_indices
from moejax.validation import require

DEFAULTS = {  # Llama4TextConfig's
  "intermediate_size": 8192,
  "intermediate_size_mlp": 16384,
  "rms_norm_eps": 1e-5,
  "num_local_experts": 16,
  "num_experts_per_tok": 1,
  "interleave_moe_layer_step": 1,
  "use_qk_norm": True,
  "no_rope_layer_interval": 4,
  "attention_chunk_size": 8192,
  "attn_temperature_tuning": True,
  "floor_scale": 8192,
  "attn_scale": 0.1,
}
DEFAULT_THETA = 500_000.0
EXPERT_TENSORS = {"w_gate": ("gate_up_proj", 0), "w_in": ("gate_up_proj", 1), "w_out": ("down_proj", None)}


def _read(hf: dict) -> dict:
  """config.json with Llama4TextConfig's defaults and its derived lists (moe_layers, no_rope_layers, layer_types)."""
  hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "attention_chunk_size"}}
  layers, step = hf["num_hidden_layers"], hf["interleave_moe_layer_step"]
  hf.setdefault("moe_layers", list(range(step - 1, layers, step)))
  interval = hf["no_rope_layer_interval"]
  hf["no_rope_layers"] = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
  chunked = hf["attention_chunk_size"] is not None
  hf.setdefault(
    "layer_types", ["chunked_attention" if r and chunked else "full_attention" for r in hf["no_rope_layers"]]
  )
  return hf


@dataclasses.dataclass(frozen=True)
class Llama4Text(Family):
  attention_bias: bool = True  # q, k, v and o alike
  moe_module: str = "feed_forward"
  shared_module: str = "shared_expert"
  renames: tuple = ((r"\.mlp\.", ".feed_forward."),)

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path[0] == "router":  # feed_forward.router.weight [E, d] (a torch Linear)
      return f"{container}.router.weight", True
    if path[0] not in EXPERT_TENSORS:
      return None
    tensor, part = EXPERT_TENSORS[path[0]]
    name = f"{container}.experts.{tensor}"
    return (name if part is None else hf_parts.block(name, part, 2)), False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    at = set(_read(hf)["moe_layers"])
    return tuple(i in at for i in range(layers))

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    hf = _read(hf)
    kinds = tuple(kind == "chunked_attention" for kind in hf["layer_types"])
    return (hf["attention_chunk_size"], kinds) if any(kinds) else (None, None)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    nope = tuple(not rope for rope in hf["no_rope_layers"][: hf["num_hidden_layers"]])
    fields = dict(
      super().decoder_fields(hf),
      d_ff=hf["intermediate_size_mlp"],
      rms_eps=hf["rms_norm_eps"],
      qk_norm=bool(hf["use_qk_norm"]),
      qk_norm_mode=qk_norm.L2.name,
      rope_interleaved=True,  # transformers' complex multiplication of consecutive pairs
      partial_rotary_factor=1.0,
      chunked_attention=any(kind == "chunked_attention" for kind in hf["layer_types"]),
      nope_layers=nope if any(nope) else None,
      attn_temperature=(float(hf["floor_scale"]), float(hf["attn_scale"]))
      if hf["attn_temperature_tuning"] and any(nope)
      else None,
    )
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    return dict(
      d_ff=hf["intermediate_size"],
      num_experts=hf["num_local_experts"],
      top_k=hf["num_experts_per_tok"],
      score="sigmoid",  # top-k of sigmoid(logits) = top-k of the logits
      weight_inputs=True,
      num_shared_experts=1,
      shared_d_ff=hf["intermediate_size"],
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    if moe_indices(cfg):
      for name, got, want in (
        ("moe.score", moe_cfg.score, "sigmoid"),
        ("moe.weight_inputs", moe_cfg.weight_inputs, True),
        ("moe.num_groups", moe_cfg.num_groups, None),
        ("moe.routed_scaling", moe_cfg.routed_scaling, 1.0),
        ("moe.num_shared_experts", moe_cfg.num_shared_experts, 1),
        ("moe.renormalize", moe_cfg.renormalize, False),
        ("moe.shared_gate", moe_cfg.shared_gate, False),
        ("moe.shared_d_ff", moe_cfg.shared_width, moe_cfg.d_ff),
        ("moe.bias_update_rate", moe_cfg.bias_update_rate, 0.0),
      ):
        require(got == want, name, got, f"{want!r}: Llama 4's config.json cannot say otherwise")
    chunked = cfg.sliding_window is not None
    for name, got, want in (
      ("rope_interleaved", cfg.rope_interleaved, True),
      ("partial_rotary_factor", cfg.partial_rotary_factor, 1.0),
      ("qk_norm_mode", cfg.qk_norm_mode if cfg.qk_norm else qk_norm.L2.name, qk_norm.L2.name),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
      ("chunked_attention", cfg.chunked_attention, chunked),
      ("attention_sinks", cfg.attention_sinks, False),
      ("clip_qkv", cfg.clip_qkv, None),
      ("attn_temperature", cfg.attn_temperature is None or float(cfg.attn_temperature[0]).is_integer(), True),
    ):
      require(got == want, name, got, f"{want!r}: Llama 4's config.json cannot say otherwise")
    nope = cfg.nope_layers or (False,) * cfg.num_layers
    temperature = cfg.attn_temperature
    return dict(
      intermediate_size=moe_cfg.d_ff,
      intermediate_size_mlp=cfg.d_ff,
      num_local_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_layers=moe_indices(cfg),
      no_rope_layers=[int(not n) for n in nope],
      use_qk_norm=cfg.qk_norm,
      attention_bias=cfg.qkv_bias,
      attn_temperature_tuning=temperature is not None,
      **({} if temperature is None else {"floor_scale": int(temperature[0]), "attn_scale": temperature[1]}),
      router_aux_loss_coef=moe_cfg.alpha,
    )

  def sliding_to_hf(self, cfg) -> dict:
    """layer_types chunked_attention where a layer's window is Llama 4's chunk; attention_chunk_size null without."""
    kinds = ["chunked_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)]
    return dict(attention_chunk_size=cfg.sliding_window, layer_types=kinds)


@dataclasses.dataclass(frozen=True)
class Llama4(Llama4Text):
  exports_as: str | None = "llama4_text"

  def decoder_config(self, hf: dict) -> dict:
    return vision_language.decoder_config(hf, self.model_type, tied=False)  # Llama4Config's default


LLAMA4_TEXT = Llama4Text("llama4_text", "Llama4ForCausalLM")
LLAMA4 = Llama4(
  "llama4",
  "Llama4ForConditionalGeneration",
  renames=(
    (r"\.mlp\.", ".feed_forward."),
    (r"^model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
  ),
  ignored=(r"^vision_model\.", r"^multi_modal_projector\."),
)
