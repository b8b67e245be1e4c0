"""ERNIE-4.5 MoE (`ernie4_5_moe`, Baidu's ERNIE-4.5-21B-A3B and -300B-A47B): Llama's attention (GQA, RoPE over the
whole head in interleaved pairs, as GLM's rotate_half of transformers' Ernie4_5), no QK-norm, no biases (use_bias
false as published); MoE layers from moe_layer_start_index to moe_layer_end_index, every moe_layer_interval-th
((i + 1) % interval == 0), the rest dense SwiGLU FFNs of intermediate_size.

Routing: softmax of the router's logits (`mlp.gate`, float32), the top moe_k experts of softmax + the balancing bias
(`mlp.moe_statics.e_score_correction_bias` [1, E], the statics' one row: `hf_parts.item`), weighted by their softmax
scores renormalised over the k with the sum clamped to at least moe_norm_min (`MoEConfig.renormalize_min`); shared
experts (`mlp.shared_experts`, moe_intermediate_size x moe_num_shared_experts wide) added unscaled. Ernie4_5_MoeConfig's
defaults where config.json is silent (theta 5e5, tied embeddings, eps 1e-5, 64 experts, top-6, 2 shared experts). The
published config.json's moe_capacity, moe_gate, moe_use_aux_free and the like are read by neither transformers nor
moejax; its MTP tensors (`mtp*`) are ignored on load as transformers ignores them.
"""

import dataclasses

from moejax.models import hf_parts
from moejax.models.families.base import Family
from moejax.models.families.deepseek import V3_BIAS_RATE
from moejax.validation import require

# Ernie4_5_MoeConfig's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {
  "rms_norm_eps": 1e-5,
  "intermediate_size": 12288,
  "tie_word_embeddings": True,
  "moe_intermediate_size": 1536,
  "moe_k": 6,
  "moe_num_experts": 64,
  "moe_num_shared_experts": 2,
  "moe_layer_start_index": 1,
  "moe_layer_end_index": -1,
  "moe_layer_interval": 1,
  "moe_norm_min": 1e-12,
  "use_bias": False,
}
DEFAULT_THETA = 500_000.0
# Ernie4_5_MoeConfig's attribute_map: config.json's names -> the fields transformers reads.
ALIASES = {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k"}


def _read(hf: dict) -> dict:
  """config.json with its aliases under the names transformers reads and Ernie4_5_MoeConfig's defaults filled in."""
  return {**DEFAULTS, **{ALIASES[k]: v for k, v in hf.items() if k in ALIASES}, **hf}


def _moe_at(start: int, end: int, interval: int, layers: int) -> tuple:
  end = layers - 1 if end == -1 else end
  return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers))


@dataclasses.dataclass(frozen=True)
class Ernie45Moe(Family):
  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path == ["expert_bias"]:  # the statics' [1, E] bias: its one row
      return hf_parts.item(f"{container}.moe_statics.e_score_correction_bias", 0, 1), False
    return None

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    hf = _read(hf)
    fields = ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
    for name in fields:
      require(isinstance(hf[name], int), name, hf[name], "an int (transformers' Ernie4_5_Moe reads one)")
    return _moe_at(*(hf[name] for name in fields), layers)

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # transformers' causal mask has no window whatever config.json says

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    require(not hf["use_bias"], "use_bias", hf["use_bias"], "false (the published checkpoints have no biases)")
    fields = dict(
      super().decoder_fields(hf),
      d_ff=hf["intermediate_size"],
      rms_eps=hf["rms_norm_eps"],
      tie_embeddings=bool(hf["tie_word_embeddings"]),
      rope_interleaved=True,
      partial_rotary_factor=1.0,  # transformers rotates the whole head whatever config.json says
    )
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    fields = dict(
      d_ff=hf["moe_intermediate_size"],
      num_experts=hf["moe_num_experts"],
      top_k=hf["moe_k"],
      score="softmax",
      renormalize=True,
      renormalize_min=float(hf["moe_norm_min"]),
      bias_update_rate=V3_BIAS_RATE,  # the checkpoint's bias, loaded while the layer keeps one
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )
    if hf["moe_num_shared_experts"]:
      fields.update(num_shared_experts=hf["moe_num_shared_experts"], shared_d_ff=hf["moe_intermediate_size"])
    return fields

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg, shared_experts=moe_cfg.num_shared_experts)
    for name, got, want in (
      ("moe.renormalize", moe_cfg.renormalize, True),
      ("moe.shared_gate", moe_cfg.shared_gate, False),
      ("moe.shared_d_ff", moe_cfg.shared_d_ff or moe_cfg.d_ff, moe_cfg.d_ff),
      ("rope_interleaved", cfg.rope_interleaved, True),
      ("partial_rotary_factor", cfg.partial_rotary_factor, 1.0),
      ("qkv_bias", cfg.qkv_bias, False),
      ("out_bias", cfg.out_bias, False),
      ("qk_norm", cfg.qk_norm, False),
      ("sliding_window", cfg.sliding_window, None),
      ("attention_sinks", cfg.attention_sinks, False),
      ("clip_qkv", cfg.clip_qkv, None),
    ):
      require(got == want, name, got, f"{want!r}: ERNIE-4.5's config.json cannot say otherwise")
    if cfg.num_moe_layers:  # the checkpoint holds the routing bias, which the layer keeps only while it balances
      rate = moe_cfg.bias_update_rate
      require(rate > 0, "moe.bias_update_rate", rate, "> 0 (the routing bias moe_statics)")
    return dict(
      **self.layers_to_hf(cfg),
      moe_num_experts=moe_cfg.num_experts,
      moe_k=moe_cfg.top_k,
      moe_intermediate_size=moe_cfg.d_ff,
      moe_num_shared_experts=moe_cfg.num_shared_experts,
      moe_norm_min=moe_cfg.renormalize_min,
      use_bias=False,
      router_aux_loss_coef=moe_cfg.alpha,
    )

  def layers_to_hf(self, cfg) -> dict:
    """moe_layer_start_index, _end_index and _interval saying cfg.moe_layers, refused where none can."""
    at = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    if not at:  # a start past the last layer: no MoE layer
      return dict(moe_layer_start_index=cfg.num_layers, moe_layer_end_index=cfg.num_layers - 1, moe_layer_interval=1)
    for interval in range(1, cfg.num_layers + 1):
      if _moe_at(at[0], at[-1], interval, cfg.num_layers) == tuple(map(bool, cfg.moe_layers)):
        return dict(moe_layer_start_index=at[0], moe_layer_end_index=at[-1], moe_layer_interval=interval)
    require(False, "moe_layers", cfg.moe_layers, "every interval-th layer from a start to an end (ERNIE-4.5's)")


# the published MTP module (`model.mtp_block.0.*`, `model.mtp_linear_proj.0.*`, ...): transformers ignores "mtp"
ERNIE4_5_MOE = Ernie45Moe("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", ignored=(r"mtp",))
