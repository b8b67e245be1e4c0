"""Kimi Linear's Kimi delta attention (KDA) as a decoder layer's token mixer (`moejax.models.token_mixers`): an nnx
module holding the layer's tensors as the published checkpoints name them under `model.layers.N.self_attn.` (q_proj,
k_proj, v_proj, q_conv1d, k_conv1d, v_conv1d, f_a_proj, f_b_proj, dt_bias, A_log, b_proj, g_a_proj, g_b_proj, o_norm,
o_proj; a kernel is the transpose of a torch Linear weight), run by the pure function
`moejax.models.mixers.kimi_delta.kimi_delta_mixer`.

Its decode cache is a pair like attention's, without a sequence axis: (the convolution's last kernel - 1 inputs
[B, kernel - 1, 3 H K] in the compute dtype, the delta rule's state [B, H, K, K] float32). Under tensor parallelism
q_proj, k_proj, v_proj split by heads and o_proj by its input heads as attention's (GSPMD keeps the layer's result);
the other tensors are replicated.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models.linear_attention import Weight
from moejax.models.mixers.kimi_delta import CONVOLUTIONS, KimiDeltaConfig, kimi_delta_mixer
from moejax.models.projections import linear

# The Linear layers of the layer (kernels [in, out]) by name, their widths from (D, H K, K, H).
LINEARS = {
  "q_proj": lambda d, w, k, h: (d, w),
  "k_proj": lambda d, w, k, h: (d, w),
  "v_proj": lambda d, w, k, h: (d, w),
  "f_a_proj": lambda d, w, k, h: (d, k),
  "f_b_proj": lambda d, w, k, h: (k, w),
  "b_proj": lambda d, w, k, h: (d, h),
  "g_a_proj": lambda d, w, k, h: (d, k),
  "g_b_proj": lambda d, w, k, h: (k, w),
  "o_proj": lambda d, w, k, h: (w, d),
}


def kda_config(cfg) -> KimiDeltaConfig:
  """The KDA layer of a `DecoderConfig`: linear_num_value_heads heads of linear_value_head_dim (q, k and v alike:
  `DecoderConfig` checks the key fields equal), the convolution linear_conv_kernel wide, the gated norm's eps rms_eps."""
  return KimiDeltaConfig(
    hidden_size=cfg.d_model,
    num_heads=cfg.linear_num_value_heads,
    head_dim=cfg.linear_value_head_dim,
    conv_kernel=cfg.linear_conv_kernel,
    rms_eps=cfg.rms_eps,
  )


class KimiDeltaAttention(nnx.Module):
  """x [B, S, d] -> y [B, S, d]; with a cache (conv, recurrent, start) -> (y, (conv, recurrent)), the cache after
  the S tokens (`start` unused: the state holds every position before)."""

  cache_has_positions = False  # its cache is rewritten whole each call (ExFlow's step asks: `moejax.infer.exflow`)

  def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
    del layer
    self.mixer_cfg = m = kda_config(cfg)
    pd, h = jnp.dtype(cfg.param_dtype), m.num_heads
    for name, widths in LINEARS.items():
      setattr(self, name, linear(cfg, *widths(cfg.d_model, m.width, m.head_dim, h), False, rngs))
    for name in CONVOLUTIONS:
      setattr(self, name, Weight(nnx.initializers.normal(0.02)(rngs.params(), (m.width, 1, m.conv_kernel), pd)))
    # transformers (as FLA) draws exp(A_log) from [1, 16] and softplus(dt_bias) from [1e-3, 0.1]: spread evenly here
    self.A_log = nnx.Param(jnp.asarray(np.log(np.linspace(1.0, 16.0, h)).reshape(1, 1, h, 1), pd))
    dt = np.geomspace(1e-3, 0.1, m.width)
    self.dt_bias = nnx.Param(jnp.asarray(dt + np.log(-np.expm1(-dt)), pd))  # softplus's inverse
    self.o_norm = Weight(jnp.ones((m.head_dim,), pd))

  def tensors(self) -> dict:
    """The layer's tensors under the checkpoints' names and layouts (`kimi_delta_mixer`'s params)."""
    return {
      **{f"{name}.weight": getattr(self, name).kernel[...].T for name in LINEARS},
      **{f"{name}.weight": getattr(self, name).weight[...] for name in CONVOLUTIONS},
      "dt_bias": self.dt_bias[...],
      "A_log": self.A_log[...],
      "o_norm.weight": self.o_norm.weight[...],
    }

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    state = None if cache is None else {"conv": cache[0], "recurrent": cache[1]}
    y_BxSxD, new = kimi_delta_mixer(self.tensors(), x_BxSxD, self.mixer_cfg, state)
    if cache is None:
      return y_BxSxD
    return y_BxSxD, (new["conv"].astype(cache[0].dtype), new["recurrent"].astype(cache[1].dtype))


def cache_specs(cfg, batch: int, length: int) -> tuple[tuple[tuple, str], tuple[tuple, str]]:
  """((shape, dtype) of the convolution's inputs [B, kernel - 1, 3 H K], of the state [B, H, K, K] float32): no
  sequence axis, so `length` is unused."""
  del length
  m = kda_config(cfg)
  conv = ((batch, m.conv_kernel - 1, m.conv_dim), cfg.dtype)
  return conv, ((batch, m.num_heads, m.head_dim, m.head_dim), "float32")
