"""EXAONE-MoE (`exaone_moe`, K-EXAONE; transformers' ExaoneMoeForCausalLM): Qwen3's attention (GQA, QK-norm per head
before RoPE, no biases) whose full-attention layers are global NoPE where sliding_window is set, keeping their QK-norm
(`DecoderConfig.nope_qk_norm`); the layers by layer_types, else every sliding_window_pattern-th full and the rest
sliding. DeepSeek-V3's MoE layers by mlp_layer_types (else after first_k_dense_replace dense layers): sigmoid routing
with the balancing bias `mlp.e_score_correction_bias` (beside the router, not in it), groups by their two best,
norm_topk_prob, x routed_scaling_factor, num_shared_experts shared experts. The MTP module (`mtp.*`) is ignored on
load, as by transformers."""

import dataclasses

from moejax.models.families.glm4_moe import GqaDeepSeekV3
from moejax.validation import require

ALIASES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}  # ExaoneMoeConfig's names
DEFAULTS = {"sliding_window": 4096, "sliding_window_pattern": 4, "first_k_dense_replace": 1, "num_shared_experts": 1}


def _read(hf: dict) -> dict:
  """config.json with ExaoneMoeConfig's defaults and derived lists (mlp_layer_types, layer_types), its MoE fields
  also under DeepSeek's names."""
  hf = {**DEFAULTS, **hf}
  layers = hf["num_hidden_layers"]
  if not hf.get("mlp_layer_types"):
    hf["mlp_layer_types"] = ["dense" if i < hf["first_k_dense_replace"] else "sparse" for i in range(layers)]
  if not hf.get("layer_types"):
    pattern = hf["sliding_window_pattern"] if hf["sliding_window"] is not None else 0
    hf["layer_types"] = [
      "sliding_attention" if pattern and (i + 1) % pattern != 0 else "full_attention" for i in range(layers)
    ]
  return {**hf, **{ALIASES[k]: v for k, v in hf.items() if k in ALIASES}}


def _global_nope(hf: dict) -> tuple | None:
  """Per layer whether it is NoPE: the full-attention layers, where there is a sliding window."""
  nope = tuple(kind == "full_attention" for kind in hf["layer_types"]) if hf["sliding_window"] is not None else ()
  return nope if any(nope) else None


@dataclasses.dataclass(frozen=True)
class ExaoneMoe(GqaDeepSeekV3):
  qk_norm: bool = True
  qk_norm_field: str | None = None
  mtp: bool = False

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return tuple(kind == "sparse" for kind in _read(hf)["mlp_layer_types"][:layers])

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return super().sliding(_read(hf), layers)

  def decoder_fields(self, hf: dict) -> dict:
    hf = _read(hf)
    return {**super().decoder_fields(hf), "nope_layers": _global_nope(hf), "nope_qk_norm": True}

  def moe_fields(self, hf: dict) -> dict:
    return super().moe_fields({**_read(hf), "topk_method": "noaux_tc", "scoring_func": "sigmoid"})  # V3's router

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    return (f"{container}.e_score_correction_bias", False) if path[0] == "expert_bias" else None

  def layers_to_hf(self, cfg) -> dict:
    return dict(mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)])

  def sliding_to_hf(self, cfg) -> dict:
    # ExaoneMoeConfig's defaults (a window of 4096, every 4th layer full) would otherwise make a window of their own.
    return super().sliding_to_hf(cfg) or dict(sliding_window=None, layer_types=["full_attention"] * cfg.num_layers)

  def to_hf(self, cfg, moe_cfg) -> dict:
    fields = super().to_hf(cfg, moe_cfg)
    hf = {"num_hidden_layers": cfg.num_layers, **self.sliding_to_hf(cfg)}
    want = _global_nope(hf)
    require(cfg.nope_layers == want, "nope_layers", cfg.nope_layers, f"{want} (EXAONE's full layers where it slides)")
    require(want is None or cfg.nope_qk_norm, "nope_qk_norm", cfg.nope_qk_norm, "True (EXAONE's NoPE layers QK-norm)")
    return {
      {"n_routed_experts": "num_experts", "n_shared_experts": "num_shared_experts"}.get(k, k): v
      for k, v in fields.items()
    }


EXAONE_MOE = ExaoneMoe("exaone_moe", "ExaoneMoeForCausalLM", ignored=(r"^mtp\.",))
