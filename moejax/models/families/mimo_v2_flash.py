"""MiMo-V2-Flash (`mimo_v2_flash`, Xiaomi): GQA whose value heads are narrower than its query and key heads (head_dim
192, v_head_dim 128: `DecoderConfig.v_head_dim`), the values times attention_value_scale (`value_scale`), q, k and v
biased by attention_bias (o_proj never), partial RoPE (half-split over the first int(head_dim x partial_rotary_factor)
dimensions), no QK-norm; full_attention and sliding_attention layers by layer_types (default: full in layer 0 and
every 6th), the sliding ones with twice the kv heads, a learned sink logit per head (`self_attn.attention_sink_bias`)
and their own RoPE theta: `DecoderConfig.sliding_overrides`. rope_parameters is per layer type ({'full_attention':
{...}, 'sliding_attention': {...}}, default RoPE each). sliding_window (default 129; config.json's
sliding_window_size + 1 where it names one, as MiMoV2FlashConfig reads it).

MoE layers by mlp_layer_types ('dense' or 'sparse'; default the first dense), routed as DeepSeek-V3 (sigmoid scores,
`mlp.gate.e_score_correction_bias` for the choice, groups by their two best, norm_topk_prob, x routed_scaling_factor,
null read as 1), no shared experts. The published MTP module (`model.mtp.*`) is ignored on load, as transformers
ignores it. MiMoV2FlashConfig's defaults where config.json is silent.
"""

import dataclasses

from moejax.models.families.base import Family
from moejax.models.families.glm4_moe import GqaDeepSeekV3
from moejax.validation import require

FULL, SLIDING = "full_attention", "sliding_attention"
# MiMoV2FlashConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {
  "head_dim": 192,
  "v_head_dim": 128,
  "num_key_value_heads": 4,
  "intermediate_size": 16384,
  "moe_intermediate_size": 2048,
  "n_routed_experts": 256,
  "num_experts_per_tok": 8,
  "norm_topk_prob": True,
  "rms_norm_eps": 1e-5,
  "sliding_window": 129,
  "attention_value_scale": 0.707,
}
DEFAULT_ROPE = {
  FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
  SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}
PARTIAL = 0.334  # MiMo's rotary embedding's default factor where a layer type's rope_parameters names none


def _read(hf: dict) -> dict:
  """config.json with MiMoV2FlashConfig's defaults and its reading of sliding_window_size and a null scaling."""
  hf = {**DEFAULTS, **hf}
  if hf.get("sliding_window_size") is not None:  # SGLang's window: that many keys behind the query, and the query
    hf["sliding_window"] = hf["sliding_window_size"] + 1
  return {**hf, "routed_scaling_factor": hf.get("routed_scaling_factor") or 1.0}


def _layer_types(hf: dict) -> list:
  layers = hf["num_hidden_layers"]
  return hf.get("layer_types") or [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(layers)]


def _rope(hf: dict, kind: str) -> tuple[float, float]:
  """(theta, partial_rotary_factor) of the layers of `kind`, refused unless its RoPE is the default one."""
  rope = hf.get("rope_parameters") or DEFAULT_ROPE
  params = rope.get(kind) if isinstance(rope.get(kind), dict) else {}
  require(
    params.get("rope_theta") is not None and params.get("rope_type", "default") == "default",
    "rope_parameters",
    rope,
    f"a default RoPE (rope_theta) for each layer type, {kind!r} included (MiMo-V2-Flash's)",
  )
  return float(params["rope_theta"]), float(params.get("partial_rotary_factor", PARTIAL))


@dataclasses.dataclass(frozen=True)
class MiMoV2Flash(GqaDeepSeekV3):
  qk_norm_field: str | None = None
  mtp: bool = False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    return tuple(kind == "sparse" for kind in kinds)

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    kinds = tuple(kind == SLIDING for kind in _layer_types(_read(hf)))
    return (_read(hf)["sliding_window"], kinds) if any(kinds) else (None, None)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    types = set(_layer_types(hf))
    theta, partial = _rope(hf, FULL if FULL in types else SLIDING)
    fields = dict(
      Family.decoder_fields(self, hf),
      out_bias=False,
      qk_norm=False,
      d_ff=hf["intermediate_size"],
      rms_eps=hf["rms_norm_eps"],
      v_head_dim=hf["v_head_dim"],
      value_scale=float(hf["attention_value_scale"] if hf["attention_value_scale"] is not None else 1.0),
      rope_theta=theta,
      rope_scaling=None,
      partial_rotary_factor=partial,
    )
    if SLIDING in types:  # twice the kv heads, sinks and their own RoPE
      theta, partial = _rope(hf, SLIDING)
      own = dict(num_kv_heads=2 * fields["num_kv_heads"], attention_sinks=True, rope_theta=theta)
      fields["sliding_overrides"] = tuple(sorted({**own, "partial_rotary_factor": partial}.items()))
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    fields = super().moe_fields({**hf, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_shared_experts": 0})
    return {**fields, "num_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"]}

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_v3_router(cfg, moe_cfg)
    sliding = [i for i in range(cfg.num_layers) if cfg.window(i)]
    own = cfg.at(sliding[0]) if sliding else cfg
    for name, got, want in (
      ("moe.num_shared_experts", moe_cfg.num_shared_experts, 0),
      ("num_mtp_layers", cfg.num_mtp_layers, 0),
      ("qk_norm", cfg.qk_norm, False),
      ("out_bias", cfg.out_bias, False),
      ("clip_qkv", cfg.clip_qkv, None),
      ("rope_interleaved", cfg.rope_interleaved, False),
      ("rope_scaling", cfg.rope_scaling, None),
      ("attention_sinks", cfg.attention_sinks, False),  # the full layers'
      ("sliding_overrides.num_kv_heads", own.num_kv_heads, 2 * cfg.num_kv_heads if sliding else cfg.num_kv_heads),
      ("sliding_overrides.attention_sinks", own.attention_sinks, bool(sliding)),
    ):
      require(got == want, name, got, f"{want!r}: MiMo-V2-Flash's config.json cannot say otherwise")
    rope = lambda c: {
      "rope_type": "default",
      "rope_theta": c.rope_theta,
      "partial_rotary_factor": c.partial_rotary_factor,
    }
    groups = moe_cfg.num_groups or 1
    return dict(
      mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)],
      n_routed_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      routed_scaling_factor=moe_cfg.routed_scaling,
      norm_topk_prob=moe_cfg.renormalize,
      n_group=groups,
      topk_group=moe_cfg.topk_groups if moe_cfg.num_groups else 1,
      attention_bias=cfg.qkv_bias,
      v_head_dim=cfg.value_dim,
      attention_value_scale=cfg.value_scale,
      rope_parameters={FULL: rope(cfg), **({SLIDING: rope(own)} if sliding else {})},
    )

  def sliding_to_hf(self, cfg) -> dict:
    # MiMoV2FlashConfig's default layer_types would otherwise make windows of their own
    return super().sliding_to_hf(cfg) or dict(layer_types=[FULL] * cfg.num_layers)


MIMO_V2_FLASH = MiMoV2Flash(
  "mimo_v2_flash",
  "MiMoV2FlashForCausalLM",
  attention_fields=("v_head_dim", "value_scale", "sliding_overrides"),
  renames=((r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias"),),
  ignored=(r"^model\.mtp\.",),
)
