"""DeepSeek-V4's attention (transformers' `DeepseekV4Attention`) of its three layer types: `sliding_attention`,
and `compressed_sparse_attention` (CSA) and `heavily_compressed_attention` (HCA), which add compressed keys
(`deepseek_v4_compressors`) after the sliding window's. Pure functions over a dict of the layer's tensors, named and
laid out as transformers stores them under `model.layers.{i}.self_attn.` (and the compressors' `compressor.*`):

  q_a_proj.weight [R_q, D], q_a_norm.weight [R_q] (float32), q_b_proj.weight [H W, R_q]
  kv_proj.weight [W, D], kv_norm.weight [W] (float32)
  o_a_proj.weight [G R_o, H W / G]: rows g R_o .. (g + 1) R_o are group g's [R_o, H W / G] block, group g reading
                  heads g H / G .. (g + 1) H / G (a block-diagonal projection stored as its blocks stacked)
  o_b_proj.weight [D, G R_o], sinks [H] (float32)

The layer: q = rmsnorm(q_b_proj(rmsnorm_w(q_a_proj(x)))) per head (the second norm unweighted); one head kv =
rmsnorm_w(kv_proj(x)) read as both key and value by every head; interleaved RoPE on the trailing R dims of each
head (R = rope_head_dim, the layout [nope | rope]) of q and kv; causal attention over the last `sliding_window`
tokens, and for CSA / HCA the compressed entries the query may see, in one softmax, scale W^-1/2, with a learned
logit per head in the softmax's denominator (gpt-oss's sinks); the output's rope part rotated back by its query's
position; the grouped low-rank output o_b_proj(o_a_proj(.)). Sliding layers rotate with the plain 'main' rope,
CSA / HCA layers every rotation with the (YaRN) 'compress' rope.

The decode cache is the rotated kv of the last `sliding_window` tokens, how many tokens it has seen, and for CSA /
HCA what the compressors carry (`deepseek_v4_compressors.empty_cache`).
"""

import dataclasses

import jax
import jax.numpy as jnp

from moejax.models import masks
from moejax.models.mixers import deepseek_v4_compressors as compressors
from moejax.models.mixers.deepseek_v4_ops import linear, rms_norm, rotate_tail
from moejax.validation import is_int, is_number, require

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATIO_LAYER_TYPES = {0: LAYER_TYPES[0], 4: LAYER_TYPES[1], 128: LAYER_TYPES[2]}  # legacy compress_ratios
_COMPRESS_RATES = {LAYER_TYPES[1]: 4, LAYER_TYPES[2]: 128}


@dataclasses.dataclass(frozen=True)
class DeepseekV4AttentionConfig:
  """D = hidden_size, H heads of W = head_dim (R = rope_head_dim of them rotated), R_q = q_lora_rank, G = o_groups
  groups of heads each projected to R_o = o_lora_rank. CSA / HCA layers: one entry per m = compress_rate tokens,
  the 'compress' rope; CSA's indexer: index_num_heads heads of index_head_dim, keeping index_topk entries."""

  hidden_size: int
  num_heads: int
  head_dim: int
  rope_head_dim: int
  q_lora_rank: int
  o_groups: int
  o_lora_rank: int
  sliding_window: int
  rms_eps: float = 1e-6
  rope_theta: float = 10000.0  # the "main" rope of sliding layers: plain, unscaled
  layer_type: str = "sliding_attention"
  compress_rate: int = 0  # 0 for sliding layers
  compress_rope_theta: float = 160000.0
  compress_rope: tuple = ()  # the 'compress' rope's scaling as (key, value) pairs (hashable: jit's static config)
  index_num_heads: int = 0  # CSA only, as the two below
  index_head_dim: int = 0
  index_topk: int = 0

  def __post_init__(self):
    for name in ("hidden_size", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank"):
      require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int")
    require(is_int(self.sliding_window), "sliding_window", self.sliding_window, "a positive int")
    even = "even and at most head_dim (interleaved RoPE rotates pairs of a head's trailing dims)"
    require(
      self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "rope_head_dim", self.rope_head_dim, even
    )
    groups = f"a divisor of num_heads={self.num_heads} (o_a_proj projects whole heads, H / G per group)"
    require(self.num_heads % self.o_groups == 0, "o_groups", self.o_groups, groups)
    require(self.layer_type in LAYER_TYPES, "layer_type", self.layer_type, f"one of {LAYER_TYPES}")
    if self.layer_type == "sliding_attention":
      require(self.compress_rate == 0, "compress_rate", self.compress_rate, "0 for a sliding_attention layer")
      return
    require(is_int(self.compress_rate), "compress_rate", self.compress_rate, f"a positive int for {self.layer_type}")
    require(is_number(self.compress_rope_theta), "compress_rope_theta", self.compress_rope_theta, "a number")
    kind = dict(self.compress_rope).get("rope_type", "default")
    require(kind in ("default", "yarn"), "compress_rope.rope_type", kind, "default or yarn")
    if self.layer_type == "compressed_sparse_attention":
      for name in ("index_num_heads", "index_topk"):
        require(is_int(getattr(self, name)), name, getattr(self, name), "a positive int for a CSA layer")
      keys = f"an int >= rope_head_dim={self.rope_head_dim} (the indexer's keys and queries rotate the same tail)"
      require(is_int(self.index_head_dim, self.rope_head_dim), "index_head_dim", self.index_head_dim, keys)

  @classmethod
  def from_hf(cls, config: dict, layer: int | None = None) -> "DeepseekV4AttentionConfig":
    """From a DeepSeek-V4 config.json (qk_rope_head_dim, or partial_rotary_factor of head_dim; the 'main' rope), for
    its `layer`-th layer (its layer_types entry, or the legacy compress_ratios'; None: a sliding layer)."""
    kind = _layer_type(config, layer)
    if kind != "sliding_attention":
      sliding = cls.from_hf(config)
      rates = {**_COMPRESS_RATES, **(config.get("compress_rates") or {})}
      for legacy, name in (("compress_rate_csa", LAYER_TYPES[1]), ("compress_rate_hca", LAYER_TYPES[2])):
        rates[name] = config.get(legacy) or rates[name]
      theta, scaling = _compress_rope(config)
      index = {}
      if kind == "compressed_sparse_attention":
        names = ("index_num_heads", "index_n_heads", 64), ("index_head_dim", "index_head_dim", 128)
        index = {ours: config.get(theirs, default) for ours, theirs, default in names}
        index["index_topk"] = config.get("index_topk", 512)
      return dataclasses.replace(
        sliding, layer_type=kind, compress_rate=rates[kind], compress_rope_theta=theta, compress_rope=scaling, **index
      )
    main = (config.get("rope_parameters") or {}).get("main") or {}
    kind = main.get("rope_type", "default")
    require(kind == "default", "rope_parameters.main.rope_type", kind, "default (sliding layers' plain RoPE)")
    head_dim = config.get("head_dim", 512)
    rope_dim = config.get("qk_rope_head_dim") or int(head_dim * (config.get("partial_rotary_factor") or 64 / 512))
    return cls(
      hidden_size=config["hidden_size"],
      num_heads=config["num_attention_heads"],
      head_dim=head_dim,
      rope_head_dim=rope_dim,
      q_lora_rank=config["q_lora_rank"],
      o_groups=config["o_groups"],
      o_lora_rank=config["o_lora_rank"],
      sliding_window=config["sliding_window"],
      rms_eps=config.get("rms_norm_eps", 1e-6),
      rope_theta=main.get("rope_theta", config.get("rope_theta", 10000.0)),
    )

  def param_shapes(self) -> dict:
    """Each tensor's shape, by its name under `self_attn.` (a compressed layer's `compressor.*` too)."""
    d, hw, rq, ro, g = (
      self.hidden_size,
      self.num_heads * self.head_dim,
      self.q_lora_rank,
      self.o_lora_rank,
      self.o_groups,
    )
    return {
      "q_a_proj.weight": (rq, d),
      "q_a_norm.weight": (rq,),
      "q_b_proj.weight": (hw, rq),
      "kv_proj.weight": (self.head_dim, d),
      "kv_norm.weight": (self.head_dim,),
      "o_a_proj.weight": (g * ro, hw // g),
      "o_b_proj.weight": (d, g * ro),
      "sinks": (self.num_heads,),
      **compressors.param_shapes(self),
    }


def _layer_type(config: dict, layer: int | None) -> str:
  """The layer's type: its layer_types entry, else its legacy compress_ratios' (0, 4, 128), else transformers'
  default (two HCA layers, then CSA and HCA alternating)."""
  if layer is None:
    return "sliding_attention"
  if config.get("layer_types"):
    return config["layer_types"][layer]
  if config.get("compress_ratios"):
    ratio = config["compress_ratios"][layer]
    require(ratio in _RATIO_LAYER_TYPES, f"compress_ratios[{layer}]", ratio, f"one of {tuple(_RATIO_LAYER_TYPES)}")
    return _RATIO_LAYER_TYPES[ratio]
  return LAYER_TYPES[2] if layer < 2 or layer % 2 == 0 else LAYER_TYPES[1]


def _compress_rope(config: dict) -> tuple[float, tuple]:
  """(theta, scaling pairs) of the 'compress' rope as transformers' DeepseekV4Config builds it: a nested
  rope_parameters.compress as it is, else the flat rope_parameters (or rope_scaling) with compress_rope_theta, YaRN's
  attention_factor 1 unless set. `truncate` is dropped: transformers reads it from the outer dict, always true."""
  params = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if isinstance(params.get("compress"), dict):
    compress = dict(params["compress"])
  else:
    compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
    compress["rope_theta"] = config.get("compress_rope_theta", 160000.0)
    compress["rope_type"] = compress.get("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
      compress.setdefault("attention_factor", 1.0)
  theta = compress.pop("rope_theta", config.get("compress_rope_theta", 160000.0))
  drop = ("type", "truncate", "partial_rotary_factor")
  return theta, tuple(sorted((k, v) for k, v in compress.items() if k not in drop and v is not None))


def check_params(params: dict, cfg: DeepseekV4AttentionConfig) -> None:
  """Raises ConfigError naming the first missing or misshapen tensor."""
  for name, shape in cfg.param_shapes().items():
    require(name in params, f"params[{name!r}]", None, f"a tensor of shape {shape}")
    got = tuple(params[name].shape)
    require(got == shape, f"params[{name!r}].shape", got, f"{shape} (transformers' layout for this config)")


def empty_cache(cfg: DeepseekV4AttentionConfig, batch: int, dtype=jnp.float32, max_length: int | None = None) -> dict:
  """The cache before any token: `kv` [B, sliding_window, W] zeros (slot j: the token sliding_window - j tokens
  back; slots before the first token stay hidden), `length`, the tokens seen (int32 0), and for CSA / HCA the
  compressors' state with room for the entries of `max_length` tokens (required there)."""
  cache = {"kv": jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype), "length": jnp.zeros((), jnp.int32)}
  if cfg.layer_type == "sliding_attention":
    return cache
  require(is_int(max_length), "max_length", max_length, f"a positive int (the tokens a {cfg.layer_type} cache holds)")
  return {**cache, **compressors.empty_cache(cfg, batch, max_length, dtype)}


def _project(params: dict, x_BxSxD: jax.Array, positions_BxS: jax.Array, cfg):
  """-> (q_BxSxHxW, kv_BxSxW) rotated at their positions, and q_residual_BxSxR_q, the normed low-rank q (CSA's
  indexer reads it)."""
  b, s, _ = x_BxSxD.shape
  check_params(params, cfg)
  q_residual = rms_norm(linear(x_BxSxD, params["q_a_proj.weight"]), params["q_a_norm.weight"], cfg.rms_eps)
  q = linear(q_residual, params["q_b_proj.weight"]).reshape(b, s, cfg.num_heads, cfg.head_dim)
  q = rms_norm(q, None, cfg.rms_eps)
  kv = rms_norm(linear(x_BxSxD, params["kv_proj.weight"]), params["kv_norm.weight"], cfg.rms_eps)
  q, kv = rotate_tail(q, positions_BxS, cfg), rotate_tail(kv[:, :, None], positions_BxS, cfg)[:, :, 0]
  return q, kv, q_residual


def _sink_attention(q_BxSxHxW, kv_BxKxW, visible_SxK, sinks_H, scale: float) -> jax.Array:
  """Softmax attention of every head over one shared key = value head -> [B, S, H, W]; each head's sink logit joins
  the softmax's denominator and takes no value (transformers' eager_attention_forward with s_aux). The logits and
  softmax in float32 (the sinks are float32, so transformers' concatenation promotes them), p v in kv's dtype. Not
  `attention.attend`: its cache mask reads slot t as position t, which a sliding cache is not. visible: [S, K] or,
  per batch row, [B, 1, S, K]."""
  logits = jnp.einsum("bshw,bkw->bhsk", q_BxSxHxW, kv_BxKxW, preferred_element_type=jnp.float32) * scale
  logits = jnp.where(visible_SxK, logits, -jnp.inf)
  sinks = jnp.broadcast_to(sinks_H.astype(jnp.float32)[None, :, None, None], (*logits.shape[:3], 1))
  probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bhsk,bkw->bshw", probs.astype(kv_BxKxW.dtype), kv_BxKxW)


def _output(params: dict, o_BxSxHxW: jax.Array, positions_BxS: jax.Array, cfg) -> jax.Array:
  """The rope part rotated back at the query's position (K = V carried each key's rotation into the values, so
  what each token adds depends on its distance to the query only), then the grouped projection -> [B, S, D]."""
  b, s, h, w = o_BxSxHxW.shape
  g, ro = cfg.o_groups, cfg.o_lora_rank
  o = rotate_tail(o_BxSxHxW, positions_BxS, cfg, sign=-1.0).reshape(b, s, g, h * w // g)
  blocks_GxRoxI = params["o_a_proj.weight"].reshape(g, ro, h * w // g).astype(o.dtype)
  grouped = jnp.einsum("bsgi,gri->bsgr", o, blocks_GxRoxI).reshape(b, s, g * ro)
  return linear(grouped, params["o_b_proj.weight"])


def _with_compressed(kv_BxKxW, visible_SxK, entries_BxTxW, visible_BxSxT):
  """The compressed entries as keys after the sliding ones -> (kv [B, K + T, W], visible [B, 1, S, K + T])."""
  b, s, _ = visible_BxSxT.shape
  sliding_BxSxK = jnp.broadcast_to(visible_SxK, (b, s, visible_SxK.shape[1]))
  visible = jnp.concatenate([sliding_BxSxK, visible_BxSxT], axis=-1)[:, None]
  return jnp.concatenate([kv_BxKxW, entries_BxTxW.astype(kv_BxKxW.dtype)], axis=1), visible


def attend(params: dict, x_BxSxD: jax.Array, positions_BxS: jax.Array, cfg: DeepseekV4AttentionConfig) -> jax.Array:
  """The layer over whole sequences (prefill, training): x_BxSxD -> y_BxSxD. positions_BxS: each token's RoPE
  position; which tokens a query sees goes by index, as transformers' mask: the t - sliding_window + 1 .. t, and
  the compressed entries of windows complete by t (CSA: those its indexer picks). Memory: the logits [B, H, S,
  S + S / m], the indexer's [B, S, H_I, S / m]."""
  s = x_BxSxD.shape[1]
  q, kv, q_residual = _project(params, x_BxSxD, positions_BxS, cfg)
  visible = masks.visible(jnp.arange(s), s, cfg.sliding_window)
  if cfg.layer_type != "sliding_attention":
    entries, visible_BxSxT = compressors.compressed_kv(params, x_BxSxD, q_residual, positions_BxS, cfg)
    kv, visible = _with_compressed(kv, visible, entries, visible_BxSxT)
  o = _sink_attention(q, kv, visible, params["sinks"], cfg.head_dim**-0.5)
  return _output(params, o, positions_BxS, cfg)


def decode(
  params: dict, x_BxSxD: jax.Array, cache: dict, positions_BxS: jax.Array, cfg: DeepseekV4AttentionConfig
) -> tuple[jax.Array, dict]:
  """The layer on the S tokens (one decoded token, or a prompt or a piece of one) that follow the `cache`'s
  (`empty_cache`'s, or the cache an earlier call returned): -> (y_BxSxD, the cache after them). Consecutive calls
  give `attend` over the whole sequence (CSA / HCA: up to the cache's max_length; the caller sizes the cache for
  the whole generation, as moejax's decode loops do, since a traced length cannot be refused here). positions_BxS:
  the new tokens' RoPE positions."""
  s, window = x_BxSxD.shape[1], cfg.sliding_window
  q, kv, q_residual = _project(params, x_BxSxD, positions_BxS, cfg)
  kv_BxKxW = jnp.concatenate([cache["kv"].astype(kv.dtype), kv], axis=1)  # key j: the token length - window + j
  keys = window + s
  # query i (key window + i) sees the window keys up to itself, less the slots before the sequence's first token
  visible = masks.visible(window + jnp.arange(s), keys, window) & (jnp.arange(keys) >= window - cache["length"])
  updated = {"kv": kv_BxKxW[:, s:].astype(cache["kv"].dtype), "length": cache["length"] + s}
  keys_BxKxW = kv_BxKxW
  if cfg.layer_type != "sliding_attention":
    entries, visible_BxSxT, compressed = compressors.decode(params, x_BxSxD, q_residual, positions_BxS, cache, cfg)
    keys_BxKxW, visible = _with_compressed(kv_BxKxW, visible, entries, visible_BxSxT)
    updated.update(compressed)
  o = _sink_attention(q, keys_BxKxW, visible, params["sinks"], cfg.head_dim**-0.5)
  return _output(params, o, positions_BxS, cfg), updated
