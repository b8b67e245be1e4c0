"""HunYuan-MoE V1 (`hunyuan_v1_moe`, Tencent's Hunyuan-A13B): GQA with q, k, v and output biases (attention_bias)
and QK-norm per head AFTER RoPE (`self_attn.query_layernorm`, `key_layernorm`: `qk_norm_mode='head_after_rope'`);
every FFN the MoE layer: a softmax top-k router renormalised over the k (`mlp.gate.wg`, float32 in transformers),
experts and one ungated shared SwiGLU FFN (`mlp.shared_mlp`), both intermediate_size wide.

config.json's moe_topk (num_experts_per_tok) may be a list, one value per layer: moejax routes every layer alike, so
a list of one value is read as that value and one of several refused. The published "dynamic" RoPE with an alpha is
NTK scaling by a fixed alpha, a plain RoPE of theta x alpha^(head_dim / (head_dim - 2)) (transformers' ntk_alpha),
read and written as that theta. transformers reads none of the published use_qk_norm, moe_intermediate_size,
num_shared_expert or use_mixed_mlp_moe fields (its attention and MoE layer are these whatever they say), and
neither does moejax.
"""

import dataclasses

from moejax.models import qk_norm
from moejax.models.families.base import Family
from moejax.validation import require

# HunYuanMoEV1Config's values of the fields a config.json may leave out, where they differ from moejax's readers'.
DEFAULTS = {"rms_norm_eps": 1e-5, "intermediate_size": 11008, "num_experts": 1}


def _per_layer(hf: dict, name: str, alias: str, default: int) -> int:
  """A field HunYuan may give per layer (moe_topk, or its alias): its one value, lists of several refused."""
  value = hf[name] if name in hf else hf.get(alias, default)
  if not isinstance(value, (list, tuple)):
    return value
  require(len(set(value)) == 1, name, value, "one value for every layer (moejax routes every MoE layer alike)")
  return value[0]


@dataclasses.dataclass(frozen=True)
class HunYuanMoeV1(Family):
  qk_norm: bool = True
  attention_bias: bool = True

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # transformers' causal mask has no window whatever config.json says

  def decoder_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    fields = dict(
      super().decoder_fields(hf),
      qk_norm_mode=qk_norm.HEAD_AFTER_ROPE.name,
      d_ff=hf["intermediate_size"],
      rms_eps=hf["rms_norm_eps"],
      partial_rotary_factor=1.0,  # transformers rotates the whole head whatever config.json says
    )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("alpha") and rope.get("rope_type", rope.get("type")) == "dynamic":
      width, theta = fields["head_dim"], rope.get("rope_theta", hf.get("rope_theta", 10000.0))
      fields.update(rope_theta=float(theta * rope["alpha"] ** (width / (width - 2))), rope_scaling=None)
    return fields

  def moe_fields(self, hf: dict) -> dict:
    hf = {**DEFAULTS, **hf}
    experts = hf["num_experts"] if "num_experts" in hf else hf.get("num_local_experts")
    require(isinstance(experts, int), "num_experts", experts, "an int (transformers' experts take one count)")
    return dict(
      d_ff=hf["intermediate_size"],
      num_experts=experts,
      top_k=_per_layer(hf, "moe_topk", "num_experts_per_tok", 1),
      renormalize=True,
      num_shared_experts=1,
      shared_d_ff=hf["intermediate_size"],
      load_balance_coef=hf.get("router_aux_loss_coef", 0.001),
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    self.require_plain_router(cfg, moe_cfg, shared_experts=1)
    for name, got, want in (
      ("moe_layers", cfg.moe_layers, (True,) * cfg.num_layers),
      ("moe.d_ff", moe_cfg.d_ff, cfg.d_ff),
      ("moe.shared_d_ff", moe_cfg.shared_width, cfg.d_ff),
      ("moe.shared_gate", moe_cfg.shared_gate, False),
      ("moe.renormalize", moe_cfg.renormalize, True),
      ("qk_norm", cfg.qk_norm, True),
      ("qk_norm_mode", cfg.qk_norm_mode, qk_norm.HEAD_AFTER_ROPE.name),
      ("out_bias", cfg.out_bias, cfg.qkv_bias),
      ("partial_rotary_factor", cfg.partial_rotary_factor, 1.0),
      ("sliding_window", cfg.sliding_window, None),
      ("attention_sinks", cfg.attention_sinks, False),
      ("clip_qkv", cfg.clip_qkv, None),
    ):
      require(got == want, name, got, f"{want!r}: HunYuan's config.json cannot say otherwise")
    return dict(
      num_experts=moe_cfg.num_experts,
      moe_topk=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      attention_bias=cfg.qkv_bias,
    )


HUNYUAN_V1_MOE = HunYuanMoeV1(
  "hunyuan_v1_moe",
  "HunYuanMoEV1ForCausalLM",
  shared_module="shared_mlp",
  renames=(
    (r"\.self_attn\.q_norm\.", ".self_attn.query_layernorm."),
    (r"\.self_attn\.k_norm\.", ".self_attn.key_layernorm."),
    (r"\.mlp\.gate\.weight$", ".mlp.gate.wg.weight"),
  ),
)
