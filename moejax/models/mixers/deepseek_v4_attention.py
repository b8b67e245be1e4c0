"""DeepSeek-V4's attention, its sliding-window branch (transformers' `DeepseekV4Attention` of a
`sliding_attention` layer; the CSA/HCA compressors are not here), as pure functions over a dict of the layer's
tensors, named and laid out as transformers stores them under `model.layers.{i}.self_attn.`:

  q_a_proj.weight [R_q, D], q_a_norm.weight [R_q] (float32), q_b_proj.weight [H W, R_q]
  kv_proj.weight [W, D], kv_norm.weight [W] (float32)
  o_a_proj.weight [G R_o, H W / G]: rows g R_o .. (g + 1) R_o are group g's [R_o, H W / G] block, group g reading
                  heads g H / G .. (g + 1) H / G (a block-diagonal projection stored as its blocks stacked)
  o_b_proj.weight [D, G R_o], sinks [H] (float32)

The layer: q = rmsnorm(q_b_proj(rmsnorm_w(q_a_proj(x)))) per head (the second norm unweighted); one head kv =
rmsnorm_w(kv_proj(x)) read as both key and value by every head; interleaved RoPE on the trailing R dims of each
head (R = rope_head_dim, the layout [nope | rope]) of q and kv; causal attention over the last `sliding_window`
tokens, scale W^-1/2, with a learned logit per head in the softmax's denominator (gpt-oss's sinks); the output's
rope part rotated back by its query's position; the grouped low-rank output o_b_proj(o_a_proj(.)).

The decode cache is the rotated kv of the last `sliding_window` tokens and how many tokens it has seen.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moejax.models import masks, rope
from moejax.validation import is_int, require


@dataclasses.dataclass(frozen=True)
class DeepseekV4AttentionConfig:
  """D = hidden_size, H heads of W = head_dim (R = rope_head_dim of them rotated), R_q = q_lora_rank, G = o_groups
  groups of heads each projected to R_o = o_lora_rank."""

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

  @classmethod
  def from_hf(cls, config: dict) -> "DeepseekV4AttentionConfig":
    """From a DeepSeek-V4 config.json (qk_rope_head_dim, or partial_rotary_factor of head_dim; the 'main' rope)."""
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
    """Each tensor's shape, by its name under `self_attn.`."""
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
    }


def check_params(params: dict, cfg: DeepseekV4AttentionConfig) -> None:
  """Raises ConfigError naming the first missing or misshapen tensor."""
  for name, shape in cfg.param_shapes().items():
    require(name in params, f"params[{name!r}]", None, f"a tensor of shape {shape}")
    got = tuple(params[name].shape)
    require(got == shape, f"params[{name!r}].shape", got, f"{shape} (transformers' layout for this config)")


def empty_cache(cfg: DeepseekV4AttentionConfig, batch: int, dtype=jnp.float32) -> dict:
  """The cache before any token: `kv` [B, sliding_window, W] zeros (slot j: the token sliding_window - j tokens
  back; slots before the first token stay hidden) and `length`, the tokens seen (int32 0)."""
  return {"kv": jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype), "length": jnp.zeros((), jnp.int32)}


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
  """x [..., in] @ weight [out, in]^T (torch's Linear layout)."""
  return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def _rms_norm(x: jax.Array, weight, eps: float) -> jax.Array:
  """transformers' DeepseekV4RMSNorm (weight is float32 and multiplies the float32 normed x, one cast at the end)
  or, weight None, DeepseekV4UnweightedRMSNorm (the float32 1/rms cast to x's dtype, the product in x's dtype)."""
  x32 = x.astype(jnp.float32)
  inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if weight is None:
    return x * inv_rms.astype(x.dtype)
  return (weight.astype(jnp.float32) * x32 * inv_rms).astype(x.dtype)


def _rotate_tail(x_BxSxHxW: jax.Array, positions_BxS: jax.Array, cfg, sign: float = 1.0) -> jax.Array:
  """Interleaved RoPE (pairs 2i, 2i + 1, kept in place) on the trailing rope_head_dim dims at each token's position;
  sign -1 rotates back (transformers' -sin). cos and sin are rounded to x's dtype, the products float32, as
  transformers'. (`rope.rotate` rotates the leading dims and regroups the pairs, which the output projection,
  reading the rotated-back output in place, would not undo.)"""
  inverse, _ = rope.frequencies(cfg.rope_head_dim, cfg.rope_theta)
  angles = positions_BxS.astype(jnp.float32)[..., None, None] * jnp.asarray(inverse, jnp.float32)  # [B, S, 1, R/2]
  cos = jnp.cos(angles).astype(x_BxSxHxW.dtype).astype(jnp.float32)
  sin = sign * jnp.sin(angles).astype(x_BxSxHxW.dtype).astype(jnp.float32)
  nope, tail = x_BxSxHxW[..., : -cfg.rope_head_dim], x_BxSxHxW[..., -cfg.rope_head_dim :].astype(jnp.float32)
  even, odd = tail[..., 0::2], tail[..., 1::2]
  pairs = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return jnp.concatenate([nope, pairs.reshape(tail.shape).astype(x_BxSxHxW.dtype)], axis=-1)


def _project(params: dict, x_BxSxD: jax.Array, positions_BxS: jax.Array, cfg):
  """-> (q_BxSxHxW, kv_BxSxW), both rotated at their positions."""
  b, s, _ = x_BxSxD.shape
  check_params(params, cfg)
  q = _rms_norm(_linear(x_BxSxD, params["q_a_proj.weight"]), params["q_a_norm.weight"], cfg.rms_eps)
  q = _rms_norm(_linear(q, params["q_b_proj.weight"]).reshape(b, s, cfg.num_heads, cfg.head_dim), None, cfg.rms_eps)
  kv = _rms_norm(_linear(x_BxSxD, params["kv_proj.weight"]), params["kv_norm.weight"], cfg.rms_eps)
  q, kv = _rotate_tail(q, positions_BxS, cfg), _rotate_tail(kv[:, :, None], positions_BxS, cfg)[:, :, 0]
  return q, kv


def _sink_attention(q_BxSxHxW, kv_BxKxW, visible_SxK, sinks_H, scale: float) -> jax.Array:
  """Softmax attention of every head over one shared key = value head -> [B, S, H, W]; each head's sink logit joins
  the softmax's denominator and takes no value (transformers' eager_attention_forward with s_aux). The logits and
  softmax in float32 (the sinks are float32, so transformers' concatenation promotes them), p v in kv's dtype. Not
  `attention.attend`: its cache mask reads slot t as position t, which a sliding cache is not."""
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
  o = _rotate_tail(o_BxSxHxW, positions_BxS, cfg, sign=-1.0).reshape(b, s, g, h * w // g)
  blocks_GxRoxI = params["o_a_proj.weight"].reshape(g, ro, h * w // g).astype(o.dtype)
  grouped = jnp.einsum("bsgi,gri->bsgr", o, blocks_GxRoxI).reshape(b, s, g * ro)
  return _linear(grouped, params["o_b_proj.weight"])


def attend(params: dict, x_BxSxD: jax.Array, positions_BxS: jax.Array, cfg: DeepseekV4AttentionConfig) -> jax.Array:
  """The layer over whole sequences (prefill, training): x_BxSxD -> y_BxSxD. positions_BxS: each token's RoPE
  position; which tokens a query sees goes by index, as transformers' mask: the t - sliding_window + 1 .. t."""
  s = x_BxSxD.shape[1]
  q, kv = _project(params, x_BxSxD, positions_BxS, cfg)
  visible_SxK = masks.visible(jnp.arange(s), s, cfg.sliding_window)
  o = _sink_attention(q, kv, visible_SxK, params["sinks"], cfg.head_dim**-0.5)
  return _output(params, o, positions_BxS, cfg)


def decode(
  params: dict, x_BxSxD: jax.Array, cache: dict, positions_BxS: jax.Array, cfg: DeepseekV4AttentionConfig
) -> tuple[jax.Array, dict]:
  """The layer on the S tokens (one decoded token, or a prompt or a piece of one) that follow the `cache`'s
  (`empty_cache`'s, or the cache an earlier call returned): -> (y_BxSxD, the cache after them). Consecutive calls
  give `attend` over the whole sequence. positions_BxS: the new tokens' RoPE positions."""
  s, window = x_BxSxD.shape[1], cfg.sliding_window
  q, kv = _project(params, x_BxSxD, positions_BxS, cfg)
  kv_BxKxW = jnp.concatenate([cache["kv"].astype(kv.dtype), kv], axis=1)  # key j: the token length - window + j
  keys = window + s
  # query i (key window + i) sees the window keys up to itself, less the slots before the sequence's first token
  visible_SxK = masks.visible(window + jnp.arange(s), keys, window) & (jnp.arange(keys) >= window - cache["length"])
  o = _sink_attention(q, kv_BxKxW, visible_SxK, params["sinks"], cfg.head_dim**-0.5)
  y = _output(params, o, positions_BxS, cfg)
  return y, {"kv": kv_BxKxW[:, s:].astype(cache["kv"].dtype), "length": cache["length"] + s}
