"""LongCat-Flash (`longcat_flash`, Meituan's LongCat-Flash-Chat): shortcut-connected MoE layers (ScMoE,
`moejax.models.shortcut_block`: per layer two MLA attentions and two dense SwiGLU FFNs of ffn_hidden_size, the MoE
branch fed by the first attention's normed output and added at the layer's end), MLA with LongCat's LoRA scaling (q
times sqrt(hidden / q_lora_rank), the kv latent times sqrt(hidden / kv_lora_rank)), interleaved rotary pairs.

config.json counts layers as `num_layers` (each of two sublayers; transformers' num_hidden_layers is twice it), and
names its widths its own way (ffn_hidden_size, expert_ffn_hidden_size, moe_topk): read here as moejax's fields.

Routing: softmax over the n_routed_experts real and zero_expert_num zero-computation experts (`mlp.router.classifier`,
float32), the top moe_topk of softmax + `mlp.router.e_score_correction_bias` [E + Z] (the layer's frozen bias with
zero experts), weighted by their softmax scores (not renormalised) times routed_scaling_factor; a zero expert's
output is the token times its weight (`MoEConfig.zero_experts`). transformers' save_pretrained writes gate_proj and
up_proj tensors for the zero experts too (its fused gate_up_proj is E + Z long), which no forward reads: ignored on
load, written as zeros (`unread_tensors`; transformers refuses a checkpoint without them). The published MTP module (`model.mtp.*`) is ignored as transformers ignores it.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from moejax.models.families.base import Family
from moejax.models.families.deepseek import LATENT_FIELDS
from moejax.validation import require

# LongcatFlashConfig's values of the fields a config.json may leave out.
DEFAULTS = {
  "num_layers": 28,
  "ffn_hidden_size": 12288,
  "q_lora_rank": 1536,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "moe_topk": 12,
  "n_routed_experts": 512,
  "zero_expert_num": 256,
  "expert_ffn_hidden_size": 2048,
  "routed_scaling_factor": 6.0,
  "rms_norm_eps": 1e-5,
}
DEFAULT_THETA = 10_000_000.0


@dataclasses.dataclass(frozen=True)
class LongcatFlash(Family):
  latent: bool = True
  block: str = "shortcut_moe"  # `moejax.models.shortcut_block`

  def decoder_config(self, hf: dict) -> dict:
    """config.json with LongcatFlashConfig's defaults and its names read as the shared fields': num_layers as
    moejax's layers (one ScMoE layer each), ffn_hidden_size, moe_topk."""
    hf = {**DEFAULTS, **hf}
    aliases = dict(num_hidden_layers=hf["num_layers"], intermediate_size=hf["ffn_hidden_size"])
    return {**hf, **aliases, "num_experts_per_tok": hf["moe_topk"]}

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    if path == ["router", "kernel"]:
      return f"{container}.router.classifier.weight", True
    if path == ["expert_bias"]:
      return f"{container}.router.e_score_correction_bias", False
    return None

  def unread_tensors(self, cfg, moe_cfg):
    """The zero experts' gate_proj and up_proj, zeros: transformers' LongcatFlashExperts holds its fused gate_up_proj
    E + Z long and refuses a checkpoint of E (no forward reads the last Z)."""
    zeros = np.zeros((moe_cfg.d_ff, cfg.d_model), jnp.dtype(cfg.param_dtype))
    for layer in range(cfg.num_layers):
      for e in range(moe_cfg.num_experts, moe_cfg.num_experts + moe_cfg.zero_experts):
        for proj in ("gate_proj", "up_proj"):
          yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", zeros

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    return (True,) * layers  # every ScMoE layer has its MoE branch

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    return None, None

  def decoder_fields(self, hf: dict) -> dict:
    rope, qk = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    head_dim = hf.get("head_dim") or rope
    require(head_dim == rope, "head_dim", head_dim, f"qk_rope_head_dim={rope} (transformers' RoPE is head_dim wide)")
    require(hf.get("qk_head_dim") in (None, qk), "qk_head_dim", hf.get("qk_head_dim"), f"{qk} (nope + rope)")
    require(hf["q_lora_rank"] is not None, "q_lora_rank", None, "an int (LongCat's q always has its latent)")
    fields = dict(
      **{k: hf[k] for k in LATENT_FIELDS},
      num_kv_heads=hf["num_attention_heads"],
      head_dim=rope,
      rope_interleaved=True,
      d_ff=hf["ffn_hidden_size"],
      rms_eps=hf["rms_norm_eps"],
    )
    if "rope_theta" not in (hf.get("rope_parameters") or {}) and "rope_theta" not in hf:
      fields["rope_theta"] = DEFAULT_THETA
    return fields

  def moe_fields(self, hf: dict) -> dict:
    require(not hf.get("router_bias"), "router_bias", hf.get("router_bias"), "false (the classifier has no bias)")
    return dict(
      d_ff=hf["expert_ffn_hidden_size"],
      num_experts=hf["n_routed_experts"],
      top_k=hf["moe_topk"],
      score="softmax",
      renormalize=False,
      routed_scaling=hf["routed_scaling_factor"],
      zero_experts=hf["zero_expert_num"] or 0,
    )

  def to_hf(self, cfg, moe_cfg) -> dict:
    for name, got, want in (
      ("moe.num_groups", moe_cfg.num_groups, None),
      ("moe.score", moe_cfg.score, "softmax"),
      ("moe.renormalize", moe_cfg.renormalize, False),
      ("moe.num_shared_experts", moe_cfg.num_shared_experts, 0),
      ("moe.router_bias", moe_cfg.router_bias, False),
      ("moe.ffn_bias", moe_cfg.ffn_bias, False),
      ("moe.activation", (moe_cfg.activation, moe_cfg.gated), ("silu", True)),
      ("rope_interleaved", cfg.rope_interleaved, True),
      ("head_dim", cfg.head_dim, cfg.qk_rope_head_dim),
      ("num_kv_heads", cfg.num_kv_heads, cfg.num_heads),
      ("sliding_window", cfg.sliding_window, None),
      ("num_mtp_layers", cfg.num_mtp_layers, 0),
      ("moe_layers", all(cfg.moe_layers), True),
    ):
      require(got == want, name, got, f"{want!r}: LongCat-Flash's config.json cannot say otherwise")
    require(cfg.q_lora_rank is not None, "q_lora_rank", None, "an int (LongCat's q always has its latent)")
    return dict(
      **{k: getattr(cfg, k) for k in LATENT_FIELDS},
      num_layers=cfg.num_layers,
      num_hidden_layers=2 * cfg.num_layers,  # transformers' count: two sublayers per layer
      ffn_hidden_size=cfg.d_ff,
      qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
      moe_topk=moe_cfg.top_k,
      n_routed_experts=moe_cfg.num_experts,
      zero_expert_num=moe_cfg.zero_experts,
      expert_ffn_hidden_size=moe_cfg.d_ff,
      routed_scaling_factor=moe_cfg.routed_scaling,
    )


# the MTP module, and the zero experts' gate/up tensors transformers' save_pretrained writes (unread): ignored
LONGCAT_FLASH = LongcatFlash(
  "longcat_flash",
  "LongcatFlashForCausalLM",
  ignored=(r"^model\.mtp\.", r"\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$"),
)
