"""Flint (`flint`, transformers' FlintForCausalLM): Qwen3's attention (GQA, QK-norm per head, an explicit head_dim,
attention_bias on q, k, v and o) with a learned sink logit per head in every layer (`self_attn.softmax_offset`, as
the hub names transformers' `sinks`), rotary only in the sliding-window layers: the full-attention layers are NoPE and
keep their QK-norm (`DecoderConfig.nope_qk_norm`). The layers by layer_types, else FlintConfig's rule (full: the first
two, every i % 4 == 1 and the last). MoE layers every decoder_sparse_step-th but those of mlp_only_layers (default
[0, 1]), Qwen2-MoE's names: the top k of sigmoid(logits) without a bias, renormalised with norm_topk_prob; one shared
expert of shared_expert_intermediate_size added in full (no gate)."""

import dataclasses

from moejax.models.families.base import moe_indices
from moejax.models.families.qwen2_moe import QwenMoe
from moejax.validation import require

DEFAULTS = {"sliding_window": 513, "head_dim": 128, "mlp_only_layers": [0, 1], "norm_topk_prob": True}  # FlintConfig's


def _read(hf: dict) -> dict:
  """config.json with FlintConfig's defaults and its derived lists (a null sliding_window stays null: no layer then
  slides, nor rotates)."""
  hf = {**DEFAULTS, **hf}
  layers = hf["num_hidden_layers"]
  full = lambda i: i < 2 or i % 4 == 1 or i == layers - 1
  hf["layer_types"] = hf.get("layer_types") or [
    "full_attention" if full(i) else "sliding_attention" for i in range(layers)
  ]
  hf["mlp_only_layers"] = DEFAULTS["mlp_only_layers"] if hf["mlp_only_layers"] is None else hf["mlp_only_layers"]
  return hf


def _nope_layers(layer_types: list, window: int | None) -> tuple | None:
  """Per layer whether it is NoPE: all but the sliding ones (only a layer with a window rotates)."""
  nope = tuple(kind != "sliding_attention" or window is None for kind in layer_types)
  return nope if any(nope) else None


@dataclasses.dataclass(frozen=True)
class Flint(QwenMoe):
  qk_norm: bool = True
  attention_bias: bool = True

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return super().moe_layers(_read(hf), layers)

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return super().sliding(_read(hf), layers)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    nope = _nope_layers(hf["layer_types"], hf["sliding_window"])
    return {**super().decoder_fields(hf), "attention_sinks": True, "nope_layers": nope, "nope_qk_norm": True}

  def moe_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    fields = {**super().moe_fields(hf), "score": "sigmoid"}
    if hf.get("shared_expert_intermediate_size"):
      fields.update(num_shared_experts=1, shared_d_ff=hf["shared_expert_intermediate_size"])
    return fields

  def to_hf(self, cfg, moe_cfg) -> dict:
    types = ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)]
    want = _nope_layers(types, cfg.sliding_window)
    checks = [("attention_sinks", cfg.attention_sinks, True), ("nope_layers", cfg.nope_layers, want)]
    checks += [("nope_qk_norm", cfg.nope_qk_norm, True)] if want else []
    checks += [("out_bias", cfg.out_bias, cfg.qkv_bias), ("qk_norm", cfg.qk_norm, True)]
    if moe_indices(cfg):
      checks += [
        ("moe.score", moe_cfg.score, "sigmoid"),
        ("moe.num_groups", moe_cfg.num_groups, None),
        ("moe.routed_scaling", moe_cfg.routed_scaling, 1.0),
        ("moe.num_shared_experts", moe_cfg.num_shared_experts, 1),
        ("moe.shared_gate", moe_cfg.shared_gate, False),
        ("moe.bias_update_rate", moe_cfg.bias_update_rate, 0.0),
      ]
    for name, got, want_value in checks:
      require(got == want_value, name, got, f"{want_value!r}: Flint's config.json cannot say otherwise")
    return {
      **self.moe_to_hf(cfg, moe_cfg),
      "attention_bias": cfg.qkv_bias,
      "shared_expert_intermediate_size": moe_cfg.shared_width,
      # FlintConfig's window (513) would otherwise slide where moejax does not
      **(self.sliding_to_hf(cfg) or dict(sliding_window=None, layer_types=types)),
    }


FLINT = Flint(
  "flint",
  "FlintForCausalLM",
  shared_module="shared_expert",
  renames=((r"\.self_attn\.sinks$", ".self_attn.softmax_offset"),),
)
