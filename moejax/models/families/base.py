"""`Family`: what one decoder family (a Hugging Face `model_type`) says its own way, in one object: its config.json
fields <-> `DecoderConfig` and `MoEConfig` fields, its checkpoint key names, and the attention and FFN its blocks
use (MLA or GQA, QK-norm, biases, shared experts). `moejax.models.hf_config` and `hf_checkpoint` hold what every
family shares and ask the family for the rest.

config.json arrives as its dict (`hf`); cfg and moe_cfg are a `DecoderConfig` and a `MoEConfig` (not imported:
`decoder_config` reads the family names from this package).
"""

import dataclasses
import re

from moejax.models import hf_parts
from moejax.validation import require

# The hub's names of the three SwiGLU weights (moejax's w_gate, w_in, w_out), Llama's and most families'.
EXPERT_NAMES = {"w_gate": "gate_proj", "w_in": "up_proj", "w_out": "down_proj"}
# Experts stacked in two tensors (gate and up fused, gate first; down): moejax's weight -> (its block of the fused
# tensor's outputs, blocks, the side the model's width d is on); `fused_expert_key`.
FUSED_EXPERTS = {"w_gate": (0, 2, "in"), "w_in": (1, 2, "in"), "w_out": (0, 1, "out")}


def rope_theta(hf: dict) -> float:
  """The RoPE theta of config.json: transformers 5's rope_parameters, else the older rope_theta, else 10000."""
  return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def num_experts(hf: dict) -> int:
  """Routed experts: num_experts (Qwen), num_local_experts (Mixtral; Qwen3-MoE as transformers 5 saves it) or
  n_routed_experts (DeepSeek)."""
  return hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0


def fused_expert_key(path: list, gate_up: str, down: str) -> tuple[str, bool] | None:
  """(HF name, transposed) of an expert weight stored stacked in `gate_up` [E, d, 2f] and `down` [E, f, d], or as
  transformers' modules hold them, [E, 2f, d] and [E, d, f] (`hf_parts.experts` reads either: `Family.hf_name` puts
  in the model's width d); None for the MoE layer's other parameters."""
  if path[0] not in FUSED_EXPERTS:
    return None
  part, blocks, side = FUSED_EXPERTS[path[0]]
  return hf_parts.experts(gate_up if blocks == 2 else down, part, blocks, side, "{d}"), False


def moe_indices(cfg) -> list[int]:
  """The layers whose FFN is the MoE layer."""
  return [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


@dataclasses.dataclass(frozen=True)
class Family:
  """One decoder family. A family module defines its subclass (the mappings) and its instance (the names).

  model_type: config.json's model_type, and `DecoderConfig.family`. architecture: config.json's architectures entry
    (the transformers class from_pretrained builds).
  latent: DeepSeek's multi-head latent attention (MLA) instead of grouped-query attention (GQA).
  qk_norm: RMSNorm of each head's q and k before RoPE (Qwen3). attention_bias: config.json's attention_bias honoured
    (Llama, Qwen3); elsewhere a true attention_bias is refused (the published checkpoints have none).
  upcycled_as: a dense family's MoE counterpart, the family `upcycle` makes of it (None: not an upcycling source).
  moe_module, expert_names, shared_module, shared_gate_module: checkpoint keys of the MoE FFN
    (`model.layers.N.<moe_module>.experts.E.<expert_names[w]>.weight`, `...<shared_module>.gate_proj.weight`,
    `model.layers.N.<moe_module>.<shared_gate_module>.weight`).
  ignored: regexes of checkpoint tensors that the family's transformers class ignores on load, and so does
    `from_hf` (Qwen3-Next's MTP module, `mtp.*`).
  hybrid: the family's config.json can say per-layer token mixers (`DecoderConfig.mixers`), gated attention and
    (1 + weight) norms (Qwen3-Next); elsewhere they are refused on export (`hf_config.to_hf_config`).
  attention_fields: the DecoderConfig fields of MiMo-V2-Flash's GQA (v_head_dim, value_scale, sliding_overrides)
    that this family's config.json says; elsewhere they are refused on export (`hf_config.to_hf_config`).
  renames: (regex, replacement) pairs, in order, from the hub's usual names (Llama's, with the MoE layer's as above)
    to this family's own anywhere in the checkpoint (`hf_name`): transformers' WeightRenaming of the family, reversed.
  exports_as: the family whose checkpoint `to_hf` writes instead of this one's (None: this one's): a
    vision-language model's decoder as its text-only class's (`vision_language`).
  block: the structure of a layer: 'sequential' (`decoder.DecoderLayer`: attention, then the FFN) or 'shortcut_moe'
    (LongCat-Flash's ScMoE layer, `moejax.models.shortcut_block`).
  """

  model_type: str
  architecture: str
  latent: bool = False
  qk_norm: bool = False
  attention_bias: bool = False
  upcycled_as: str | None = None
  moe_module: str = "mlp"
  expert_names: dict = dataclasses.field(default_factory=lambda: dict(EXPERT_NAMES))
  shared_module: str = "shared_experts"
  shared_gate_module: str = "shared_expert_gate"
  renames: tuple = ()
  hybrid: bool = False
  ignored: tuple = ()
  attention_fields: tuple = ()
  exports_as: str | None = None
  block: str = "sequential"

  @property
  def sequential(self) -> bool:
    """Whether a layer is `decoder.DecoderLayer` (attention, then the FFN: the block post_norm and the residual
    multiplier act in)."""
    return self.block == "sequential"

  def decoder_config(self, hf: dict) -> dict:
    """The config.json dict of the decoder: `hf` itself; a vision-language model's the decoder's fields under its
    text_config (`vision_language.decoder_config`)."""
    return hf

  def hf_name(self, name: str, cfg) -> str:
    """The name in this family's checkpoints of the tensor the hub usually calls `name` (`model.embed_tokens.weight`,
    `model.layers.N.self_attn.q_norm.weight`, ...): `renames` applied. A family storing a tensor inside another
    returns its part (`hf_parts`: Sarvam's q, k and v rows of one fused tensor; stacked experts' parts, told apart
    by the model's width: `fused_expert_key`)."""
    for pattern, replacement in self.renames:
      name = re.sub(pattern, replacement, name)
    return name.replace("{d}", str(cfg.d_model))

  def moe_key(self, container: str, path: list) -> tuple[str, bool] | None:
    """(HF name, transposed) of the MoE layer's parameter `path` (under ffn/moe) where the family stores it its own
    way (a name may be a part of a stored tensor: `hf_parts`); None: the hub's usual names."""
    del container, path
    return None

  def ignored_tensors(self, moe_cfg) -> tuple:
    """Regexes of the checkpoint's tensors `from_hf` ignores, as this family's transformers class does: `ignored`,
    and where that depends on the config, more (ERNIE-4.5-VL's vision experts, numbered after the text ones)."""
    del moe_cfg
    return self.ignored

  def unread_tensors(self, cfg, moe_cfg):
    """(HF name, host array) of the tensors `to_hf` writes beyond the model's own: ones this family's transformers
    class needs in a checkpoint but no forward reads (LongCat-Flash's zero experts' projections, zeros)."""
    del cfg, moe_cfg
    return ()

  # config.json -> DecoderConfig and MoEConfig fields

  def moe_layers(self, hf: dict, layers: int) -> tuple:
    """Per layer, whether its FFN is the MoE layer (`DecoderConfig.moe_layers`)."""
    raise NotImplementedError

  def sliding(self, hf: dict, layers: int) -> tuple[int | None, tuple | None]:
    """(sliding_window, sliding_layers): transformers 5's layer_types, or the older use_sliding_window from layer
    max_window_layers on; (None, None) without a window."""
    if hf.get("layer_types"):
      kinds = tuple(kind == "sliding_attention" for kind in hf["layer_types"])
      return (hf.get("sliding_window"), kinds) if any(kinds) else (None, None)
    if hf.get("use_sliding_window"):
      return hf["sliding_window"], tuple(i >= hf.get("max_window_layers", 0) for i in range(layers))
    return None, None

  def decoder_fields(self, hf: dict) -> dict:
    """The DecoderConfig fields this family sets its own way: attention's (heads, head width, biases, QK-norm;
    MLA's ranks and rotary layout) and DeepSeek-V3's MTP modules. GQA here: q, k, v and output biases all as
    attention_bias."""
    heads, bias = hf["num_attention_heads"], bool(hf.get("attention_bias"))
    return dict(
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      qkv_bias=bias,
      out_bias=bias,
      qk_norm=self.qk_norm,
    )

  def moe_fields(self, hf: dict) -> dict:
    """The MoEConfig fields of the routed layer beyond those every family shares (gated SiLU experts, top_k,
    d_model, num_experts): the experts' width, the checkpoint's routing and balancing, the shared experts."""
    raise NotImplementedError

  # DecoderConfig and MoEConfig -> config.json

  def to_hf(self, cfg, moe_cfg) -> dict:
    """This family's config.json fields of a decoder, refusing by name what the family's config.json cannot say."""
    raise NotImplementedError

  def sliding_to_hf(self, cfg) -> dict:
    """The sliding window as layer_types (transformers 5); nothing without a window."""
    if cfg.sliding_window is None:
      return {}
    return dict(
      sliding_window=cfg.sliding_window,
      layer_types=["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)],
    )

  def require_plain_router(self, cfg, moe_cfg, shared_experts: int = 0) -> None:
    """A GQA family's router is softmax top-k and nothing else (no groups, no sigmoid, no scaling), its shared
    experts the ones its config.json can say; refused by the MoEConfig field otherwise."""
    if not moe_indices(cfg):
      return
    for name, plain in (
      ("num_groups", None),
      ("score", "softmax"),
      ("routed_scaling", 1.0),
      ("num_shared_experts", shared_experts),
    ):
      require(
        getattr(moe_cfg, name) == plain,
        f"moe.{name}",
        getattr(moe_cfg, name),
        f"{plain!r}: {cfg.family}'s config.json cannot say otherwise",
      )
