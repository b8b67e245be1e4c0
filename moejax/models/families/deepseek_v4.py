"""DeepSeek-V4 (`deepseek_v4`, transformers' DeepseekV4ForCausalLM): mHC layers (`moejax.models.hyper_block`: hc_mult
residual streams, each sublayer behind a hyper-connection, the hyper head before the final norm) whose attention is
sliding, CSA or HCA by layer_types ('deepseek_v4' mixer, `moejax.models.deepseek_v4_mixer`: one shared K = V head,
sinks, the compressors and CSA's indexer) and whose FFN is MoE in every layer: the mlp_layer_types 'hash_moe' layers
choose experts by the token id table tid2eid (`DecoderConfig.hash_layers`, routing 'hash'), the 'moe' ones the top k
of sqrtsoftplus scores plus the gate's bias; both weight by the scores renormalised, times routed_scaling_factor; a
shared expert; DeepSeek-V4's clamped SwiGLU (swiglu_limit) in routed and shared experts alike.

Names: the published ones, as save_pretrained writes them (transformers' conversion reversed: `renames`):
`model.layers.N.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink}`, `attn.compressor.{wkv, wgate, ape,
norm}`, `attn.indexer.{compressor.*, wq_b, weights_proj}`, `attn_norm`, `ffn_norm`, `hc_attn_{fn, base, scale}`,
`hc_ffn_*`, `ffn.gate.{weight, bias, tid2eid}`, `ffn.experts.E.w1/w2/w3`, `ffn.shared_experts.w1/w2/w3`,
`model.hc_head.*`, `head.weight`. The published MTP layers (`mtp.*`) are ignored, as transformers ignores them.
"""

import dataclasses

from moejax.models.deepseek_v4_mixer import freeze, hf_fields
from moejax.models.families.base import Family
from moejax.models.families.deepseek import V3_BIAS_RATE
from moejax.validation import require

# The config.json fields DeepSeek-V4's attention and mHC read (`DecoderConfig.deepseek_v4`).
ATTENTION_FIELDS = (
  "hidden_size",
  "num_attention_heads",
  "head_dim",
  "qk_rope_head_dim",
  "partial_rotary_factor",
  "q_lora_rank",
  "o_groups",
  "o_lora_rank",
  "sliding_window",
  "rms_norm_eps",
  "rope_theta",
  "rope_parameters",
  "rope_scaling",
  "layer_types",
  "compress_ratios",
  "compress_rates",
  "compress_rate_csa",
  "compress_rate_hca",
  "compress_rope_theta",
  "index_n_heads",
  "index_head_dim",
  "index_topk",
  "hc_mult",
  "hc_sinkhorn_iters",
  "hc_eps",
)
SHARED = r"(shared_experts)"
RENAMES = (
  (r"^lm_head\.", "head."),
  (r"\.input_layernorm\.", ".attn_norm."),
  (r"\.post_attention_layernorm\.", ".ffn_norm."),
  (r"\.attn_hc\.", ".hc_attn_"),
  (r"\.ffn_hc\.", ".hc_ffn_"),
  (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
  (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
  (r"\.compressor\.indexer\.", ".indexer.compressor."),
  (r"\.self_attn\.", ".attn."),
  (r"\.mlp\.hash_table$", ".mlp.gate.tid2eid"),
  (r"\.mlp\.", ".ffn."),
  (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
  (rf"\.{SHARED}\.gate_proj\.", r".\1.w1."),
  (rf"\.{SHARED}\.up_proj\.", r".\1.w3."),
  (rf"\.{SHARED}\.down_proj\.", r".\1.w2."),
  (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
  (r"\.q_a_proj\.", ".wq_a."),
  (r"\.q_a_norm\.", ".q_norm."),
  (r"\.q_b_proj\.", ".wq_b."),
  (r"\.kv_proj\.", ".wkv."),
  (r"\.kv_norm\.", ".norm."),
  (r"\.position_bias$", ".ape"),
  (r"\.o_a_proj\.", ".wo_a."),
  (r"\.o_b_proj\.", ".wo_b."),
  (r"\.sinks$", ".attn_sink"),
)


def mlp_layer_types(hf: dict) -> list:
  """Per layer 'hash_moe' or 'moe', as DeepseekV4Config derives them (num_hash_layers, default 3, hash layers first)."""
  layers = hf["num_hidden_layers"]
  if hf.get("mlp_layer_types"):
    return list(hf["mlp_layer_types"])[:layers]
  hashed = min(layers, hf.get("num_hash_layers", 3))
  return ["hash_moe"] * hashed + ["moe"] * (layers - hashed)


@dataclasses.dataclass(frozen=True)
class DeepSeekV4(Family):
  hybrid: bool = True  # layer_types names the layers' attention kind, not windows
  block: str = "hyper_connected"

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    kinds = mlp_layer_types(hf)
    require(len(kinds) == layers and set(kinds) <= {"hash_moe", "moe"}, "mlp_layer_types", kinds, "'hash_moe' or 'moe'")
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # the window is the attention's own (`deepseek_v4` fields)

  def decoder_fields(self, hf: dict) -> dict:
    layers = hf["num_hidden_layers"]
    return dict(
      num_kv_heads=1,
      head_dim=hf.get("head_dim", 512),
      d_ff=hf["moe_intermediate_size"],
      mixers=("deepseek_v4",) * layers,
      deepseek_v4=freeze(hf, ATTENTION_FIELDS),
      hash_layers=tuple(kind == "hash_moe" for kind in mlp_layer_types(hf)),
      num_mtp_layers=0,
    )

  def moe_fields(self, hf: dict) -> dict:
    return dict(
      d_ff=hf["moe_intermediate_size"],
      score=hf.get("scoring_func", "sqrtsoftplus"),
      renormalize=bool(hf.get("norm_topk_prob", True)),
      routed_scaling=hf.get("routed_scaling_factor", 1.5),
      activation="swiglu_clamped_v4",
      swiglu_limit=hf.get("swiglu_limit", 10.0),
      num_shared_experts=hf.get("n_shared_experts", 1),
      shared_d_ff=hf["moe_intermediate_size"],
      bias_update_rate=V3_BIAS_RATE,  # the gate's bias (e_score_correction_bias) as DeepSeek-V3's, kept as state
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    """The attention's and mHC's fields as read (`DecoderConfig.deepseek_v4`), the MoE layers' and which route by
    the token id table (mlp_layer_types); refuses what DeepSeek-V4's config.json cannot say."""
    fields, layers = hf_fields(cfg), cfg.num_layers
    for field, name in (("d_model", "hidden_size"), ("num_heads", "num_attention_heads"), ("head_dim", "head_dim")):
      got = getattr(cfg, field)
      require(fields.get(name, got) == got, field, got, f"{fields.get(name)!r}, the attention's {name}")
    require(cfg.mixers == ("deepseek_v4",) * layers, "mixers", cfg.mixers, "'deepseek_v4' in every layer")
    require(all(cfg.is_moe(i) for i in range(layers)), "moe_layers", cfg.moe_layers, "every layer MoE (DeepSeek-V4's)")
    require(moe_cfg.activation == "swiglu_clamped_v4", "moe.activation", moe_cfg.activation, "'swiglu_clamped_v4'")
    hashed = cfg.hash_layers or (False,) * layers
    return {
      **fields,
      "num_key_value_heads": 1,
      "n_routed_experts": moe_cfg.num_experts,
      "num_experts_per_tok": moe_cfg.top_k,
      "moe_intermediate_size": moe_cfg.d_ff,
      "n_shared_experts": moe_cfg.num_shared_experts,
      "routed_scaling_factor": moe_cfg.routed_scaling,
      "norm_topk_prob": moe_cfg.renormalize,
      "scoring_func": moe_cfg.score,
      "swiglu_limit": moe_cfg.swiglu_limit,
      "mlp_layer_types": ["hash_moe" if hash_layer else "moe" for hash_layer in hashed],
      "num_nextn_predict_layers": 0,
    }


DEEPSEEK_V4 = DeepSeekV4(
  "deepseek_v4",
  "DeepseekV4ForCausalLM",
  expert_names={"w_gate": "w1", "w_in": "w3", "w_out": "w2"},
  renames=RENAMES,
  ignored=(r"(^|\.)mtp\.",),
)
