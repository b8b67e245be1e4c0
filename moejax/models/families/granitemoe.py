"""Granite MoE (`granitemoe`, IBM Granite 3 MoE; transformers' GraniteMoeForCausalLM): Mixtral's decoder (GQA,
attention_bias on q, k, v and o, every layer MoE, the top k of the logits softmaxed over the k, which is softmax top-k
renormalised) with Granite's muP scalars (`moejax.models.mup`: embedding_multiplier, residual_multiplier,
attention_multiplier as attention's softmax scale, logits_scaling) and its names: the router
`block_sparse_moe.router.layer`, the experts stacked in `block_sparse_moe.input_linear.weight` (gate rows, then up
rows: [E, 2f, d]) and `output_linear.weight` ([E, d, f]; `families.base.fused_expert_key`). No sliding window.
`granitemoeshared` (GraniteMoeSharedForCausalLM) adds, where shared_intermediate_size > 0, a shared SwiGLU beside
each MoE block added in full (no gate): `model.layers.N.shared_mlp.input_linear.weight` [2s, d] (the gate rows, then
the up ones: `hf_parts.block` of the first axis) and `output_linear.weight` [d, s]."""

import dataclasses

from moejax.models import hf_parts, mup
from moejax.models.families.base import Family, fused_expert_key, moe_indices
from moejax.validation import require

DEFAULTS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0, "logits_scaling": 1.0}


@dataclasses.dataclass(frozen=True)
class GraniteMoe(Family):
  """shared: granitemoeshared's shared_mlp beside each MoE block."""

  attention_bias: bool = True
  moe_module: str = "block_sparse_moe"
  shared: bool = False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None  # GraniteMoeConfig has no window

  def decoder_fields(self, hf: dict) -> dict:
    scalars = {name: float(hf.get(name) if hf.get(name) is not None else DEFAULTS[name]) for name in mup.SCALARS}
    return {**super().decoder_fields(hf), **scalars}

  def moe_fields(self, hf: dict) -> dict:
    fields = dict(
      d_ff=hf["intermediate_size"], renormalize=True, load_balance_coef=hf.get("router_aux_loss_coef", 0.001)
    )
    if self.shared and hf.get("shared_intermediate_size"):
      fields.update(num_shared_experts=1, shared_d_ff=hf["shared_intermediate_size"])
    return fields

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path[0] == "router":
      return f"{container}.router.layer.weight", True
    if path[0] == "shared":  # beside the MoE block: model.layers.N.shared_mlp
      mlp = f"{container.rsplit('.', 1)[0]}.shared_mlp"
      if path[1] == "w_out":
        return f"{mlp}.output_linear.weight", True
      return hf_parts.block(f"{mlp}.input_linear.weight", int(path[1] == "w_in"), 2, axis=0), True
    return fused_expert_key(path, f"{container}.input_linear.weight", f"{container}.output_linear.weight")

  def to_hf(self, cfg, moe_cfg) -> dict:
    shared = min(moe_cfg.num_shared_experts, 1) if self.shared else 0
    self.require_plain_router(cfg, moe_cfg, shared_experts=shared)
    require(
      len(moe_indices(cfg)) == cfg.num_layers, "moe_layers", cfg.moe_layers, "all True (Granite has no dense layers)"
    )
    require(moe_cfg.renormalize, "moe.renormalize", moe_cfg.renormalize, "True (Granite softmaxes the top k)")
    require(not moe_cfg.shared_gate, "moe.shared_gate", moe_cfg.shared_gate, "False (Granite's shared MLP has no gate)")
    require(cfg.out_bias == cfg.qkv_bias, "out_bias", cfg.out_bias, f"qkv_bias={cfg.qkv_bias} (attention_bias)")
    require(cfg.sliding_window is None, "sliding_window", cfg.sliding_window, "None (Granite MoE has no window)")
    return dict(
      num_local_experts=moe_cfg.num_experts,
      num_experts_per_tok=moe_cfg.top_k,
      intermediate_size=moe_cfg.d_ff,
      router_aux_loss_coef=moe_cfg.alpha,
      attention_bias=cfg.qkv_bias,
      **{name: getattr(cfg, name) for name in mup.SCALARS if name != "attention_multiplier"},
      attention_multiplier=mup.softmax_scale(cfg),
      **({"shared_intermediate_size": moe_cfg.shared_width if shared else 0} if self.shared else {}),
    )


GRANITEMOE = GraniteMoe("granitemoe", "GraniteMoeForCausalLM")
GRANITEMOESHARED = GraniteMoe("granitemoeshared", "GraniteMoeSharedForCausalLM", shared=True)
