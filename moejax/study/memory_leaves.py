"""The analytic count's parameter tensors (`memory.analytic_leaves`), written out from the configs' dimensions: a
decoder's embeddings and head, each layer's token mixer by its kind (`DecoderConfig.mixer`: attention, gated
DeltaNet, Kimi delta attention, DSA with its indexer, DeepSeek-V4's attention), its norms and FFN, and the blocks that
are not one mixer and one FFN (DeepSeek-V4's mHC modules and hyper head; LongCat-Flash's ScMoE layer: two attentions,
two dense FFNs and the MoE branch). Checked against transformers' parameter count of each published 2026 model
(`tests/test_published_configs.py`)."""

import dataclasses
import math

from moejax.models import hyper_block, qk_norm, shortcut_block
from moejax.models.decoder_config import DecoderConfig
from moejax.models.deepseek_v4_mixer import ONES, ZEROS, attention_config
from moejax.models.kimi_delta_attention import CONVOLUTIONS, LINEARS, kda_config
from moejax.models.linear_attention import deltanet_config
from moejax.models.sparse_attention import indexer_fields


@dataclasses.dataclass
class Leaf:
  """One parameter tensor of the analytic count: its shape, how many the model has, and where it lives ('dense':
  replicated or FSDP-sharded; 'expert': split over the expert holders; 'moe': the MoE layer's own replicated
  tensors, routers and shared experts, which FSDP leaves alone). table: an embedding table or the output head
  (Muon leaves these to AdamW, as it does every tensor that is not 2-D or a routed expert's). float32: kept in
  float32 whatever the parameters' dtype (DeepSeek-V4's norms, sinks and mHC tensors, as transformers keeps them)."""

  shape: tuple
  count: int = 1
  kind: str = "dense"
  table: bool = False
  float32: bool = False

  @property
  def muon(self) -> bool:
    """Whether optim.name='muon' orthogonalises it (one momentum) rather than AdamW's two moments."""
    return self.kind == "expert" or (len(self.shape) == 2 and not self.table)


def size(leaves: list) -> int:
  """Elements of `leaves`."""
  return sum(math.prod(leaf.shape) * leaf.count for leaf in leaves)


def attention_leaves(cfg) -> list:
  """Grouped-query or latent attention's tensors (no norms around it) of a layer's config (`DecoderConfig.at`)."""
  d, h, hd = cfg.d_model, cfg.num_heads, cfg.head_dim
  if cfg.latent:
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
      out = [Leaf((d, cfg.q_lora_rank)), Leaf((cfg.q_lora_rank,)), Leaf((cfg.q_lora_rank, h * qk))]
    else:
      out = [Leaf((d, h * qk))]
    return out + [
      Leaf((d, cfg.kv_lora_rank + cfg.qk_rope_head_dim)),
      Leaf((cfg.kv_lora_rank,)),
      Leaf((cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))),
      Leaf((h * cfg.v_head_dim, d)),
    ]
  kv, v = cfg.num_kv_heads * hd, cfg.num_kv_heads * cfg.value_dim  # MiMo's values narrower than q and k
  q = h * hd * (2 if cfg.gated_attention else 1)  # gated attention: each head's query and its output gate
  out = [Leaf((d, q)), Leaf((d, kv)), Leaf((d, v)), Leaf((h * cfg.value_dim, d))]
  out += [Leaf((h * hd,)), Leaf((kv,)), Leaf((v,))] if cfg.qkv_bias else []
  out += [Leaf((d,))] if cfg.out_bias else []
  out += [Leaf((h,))] if cfg.attention_sinks else []  # a logit per head in the softmax's denominator
  if cfg.qk_norm:  # per head ([hd] each of q, k) or over the whole projections ([h hd], [kv])
    out += [Leaf(shape) for shape in qk_norm.of(cfg).shapes(cfg)]
  return out


def _gated_deltanet(cfg) -> list:
  m, d = deltanet_config(cfg), cfg.d_model
  if cfg.linear_split_projections:  # Qwen3.5-MoE's q k v together, z, b, a
    widths = (m.conv_dim, m.value_dim, m.num_v_heads, m.num_v_heads)
  else:  # Qwen3-Next's qkvz and ba
    widths = (2 * m.key_dim + 2 * m.value_dim, 2 * m.num_v_heads)
  out = [Leaf((d, w)) for w in widths] + [Leaf((m.conv_dim, 1, m.conv_kernel))]
  return out + [Leaf((m.num_v_heads,), 2), Leaf((m.head_v_dim,)), Leaf((m.value_dim, d))]  # dt_bias, A_log


def _kimi_delta(cfg) -> list:
  m = kda_config(cfg)
  out = [Leaf(widths(cfg.d_model, m.width, m.head_dim, m.num_heads)) for widths in LINEARS.values()]
  out += [Leaf((m.width, 1, m.conv_kernel), len(CONVOLUTIONS))]
  return out + [Leaf((m.num_heads,)), Leaf((m.width,)), Leaf((m.head_dim,))]  # A_log, dt_bias, o_norm


def _dsa(cfg) -> list:
  """MLA and its lightning indexer: wq_b from q's latent, wk, the keys' LayerNorm (weight, bias), weights_proj."""
  fields = indexer_fields(cfg)
  heads, width = fields["heads"], fields["head_dim"]
  indexer = [Leaf((cfg.q_lora_rank, heads * width)), Leaf((cfg.d_model, width)), Leaf((width,), 2)]
  return attention_leaves(cfg) + indexer + [Leaf((cfg.d_model, heads))]


def _deepseek_v4(cfg, layer: int) -> list:
  """Its shapes are its layer type's config's, by transformers' names (norms, sinks, biases in float32)."""
  shapes = attention_config(cfg, layer).param_shapes()
  return [Leaf(tuple(shape), float32=name.endswith(ONES + ZEROS)) for name, shape in shapes.items()]


def _of_layer(leaves):
  """A mixer whose tensors read only its layer's config (`DecoderConfig.at`: MiMo's sliding layers' own heads)."""
  return lambda cfg, layer: leaves(cfg.at(layer))


MIXER_LEAVES = {  # by `DecoderConfig.mixer`'s names: (cfg, layer) -> the mixer's tensors
  "attention": _of_layer(attention_leaves),
  "gated_deltanet": _of_layer(_gated_deltanet),
  "kimi_delta": _of_layer(_kimi_delta),
  "dsa": _of_layer(_dsa),
  "dsa_shared": _of_layer(attention_leaves),  # it reuses the last 'dsa' layer's choice: no indexer of its own
  "deepseek_v4": _deepseek_v4,
}


def mixer_leaves(cfg, layer: int) -> list:
  """Layer `layer`'s token mixer's tensors."""
  return MIXER_LEAVES[cfg.mixer(layer)](cfg, layer)


def dense_ffn_leaves(cfg) -> list:
  d = cfg.d_model
  return [Leaf((d, cfg.d_ff), 2), Leaf((cfg.d_ff, d))]


def moe_leaves(moe_cfg) -> list:
  """One MoE layer's: its router kernels, routed experts and shared experts (with their gate)."""
  d, f, e = moe_cfg.d_model, moe_cfg.d_ff, moe_cfg.num_experts
  widths = list(moe_cfg.router.widths.values())  # the router kernels [d, width]
  mats = 3 if moe_cfg.gated else 2
  out = [Leaf((d, w), kind="moe") for w in widths] + [Leaf((e, d, f), mats, "expert")]
  if moe_cfg.num_shared_experts:
    out.append(Leaf((d, moe_cfg.shared_width), mats, "moe"))
  return out + ([Leaf((d, 1), kind="moe")] if moe_cfg.shared_gate else [])


def layer_leaves(cfg: DecoderConfig, moe_cfg, layer: int) -> list:
  """Decoder layer `layer`'s tensors: its norms, token mixer and FFN (MoE or dense), and its block's own."""
  d, is_moe = cfg.d_model, cfg.moe_layers[layer]
  ffn = moe_leaves(moe_cfg) if is_moe else dense_ffn_leaves(cfg)
  if shortcut_block.uses(cfg):  # two (norm, attention, norm, dense FFN) sublayers, and the MoE branch
    sublayer = [Leaf((d,), 2)] + mixer_leaves(cfg, layer) + dense_ffn_leaves(cfg)
    return [dataclasses.replace(x, count=x.count * shortcut_block.SUBLAYERS) for x in sublayer] + ffn
  out = [Leaf((d,), 2)] + mixer_leaves(cfg, layer) + ffn
  if hyper_block.uses(cfg):  # an mHC module around each sublayer: fn, base, scale
    hc = hyper_block.hyper_config(cfg)
    mhc = [((hc.num_weights, hc.hc_mult * d), 2), ((hc.num_weights,), 2), ((3,), 2)]
    out += [Leaf(shape, count, float32=True) for shape, count in mhc]
  return out


def top_leaves(cfg: DecoderConfig) -> list:
  """The embeddings, the final norm, the output head (untied) and DeepSeek-V4's hyper head."""
  d = cfg.d_model
  out = [Leaf((cfg.vocab_size, d), table=True), Leaf((d,))]
  out += [] if cfg.tie_embeddings else [Leaf((d, cfg.vocab_size), table=True)]
  if hyper_block.uses(cfg):
    n = hyper_block.hyper_config(cfg).hc_mult
    out += [Leaf(shape, float32=True) for shape in ((n, n * d), (n,), (1,))]
  return out


def decoder_leaves(cfg) -> tuple[list, list, list]:
  """(model-level leaves, one layer's attention with its two norms, the dense FFN's) of a decoder whose layers
  are all alike (the sweep's point models)."""
  return top_leaves(cfg), [Leaf((cfg.d_model,), 2)] + attention_leaves(cfg), dense_ffn_leaves(cfg)
