"""Qwen3-Next's gated DeltaNet layer as a decoder layer's token mixer (`moejax.models.token_mixers`): an nnx module
holding the layer's tensors as transformers names them under `model.layers.N.linear_attn.` (in_proj_qkvz, in_proj_ba,
or with `DecoderConfig.linear_split_projections` Qwen3.5-MoE's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; conv1d,
dt_bias, A_log, norm, out_proj; a kernel is the transpose of a torch Linear weight), run by the pure function
`moejax.models.mixers.gated_deltanet.gated_deltanet_mixer`, which reads either layout.

Its decode cache is a pair like attention's, without a sequence axis: (the convolution's last kernel - 1 inputs
[B, kernel - 1, conv_dim] in the compute dtype, the delta rule's state [B, H, K, V] float32). Under tensor
parallelism its parameters are replicated: each GPU of a node runs the whole layer on the node's tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models.mixers.gated_deltanet import GatedDeltaNetConfig, gated_deltanet_mixer
from moejax.models.projections import linear


def deltanet_config(cfg) -> GatedDeltaNetConfig:
  """The gated DeltaNet layer of a `DecoderConfig` (its linear_* fields; the gated norm's eps is rms_eps)."""
  return GatedDeltaNetConfig(
    hidden_size=cfg.d_model,
    num_k_heads=cfg.linear_num_key_heads,
    num_v_heads=cfg.linear_num_value_heads,
    head_k_dim=cfg.linear_key_head_dim,
    head_v_dim=cfg.linear_value_head_dim,
    conv_kernel=cfg.linear_conv_kernel,
    rms_eps=cfg.rms_eps,
  )


class Weight(nnx.Module):
  """A tensor named `weight` in the checkpoint (conv1d.weight, norm.weight): a module holding one Param."""

  def __init__(self, value: jax.Array):
    self.weight = nnx.Param(value)


class GatedDeltaNet(nnx.Module):
  """x [B, S, d] -> y [B, S, d]; with a cache (conv, recurrent, start) -> (y, (conv, recurrent)), the cache after
  the S tokens (`start` unused: the state holds every position before)."""

  cache_has_positions = False  # its cache is rewritten whole each call (ExFlow's step asks: `moejax.infer.exflow`)

  def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
    del layer
    self.mixer_cfg = m = deltanet_config(cfg)
    pd, d, h = jnp.dtype(cfg.param_dtype), cfg.d_model, m.num_v_heads
    if cfg.linear_split_projections:  # Qwen3.5-MoE's: all q, all k, all v; z; b; a
      widths = {"in_proj_qkv": m.conv_dim, "in_proj_z": m.value_dim, "in_proj_b": h, "in_proj_a": h}
    else:  # Qwen3-Next's: grouped per key head
      widths = {"in_proj_qkvz": 2 * m.key_dim + 2 * m.value_dim, "in_proj_ba": 2 * h}
    self.projections = tuple(widths)
    for name, width in widths.items():
      setattr(self, name, linear(cfg, d, width, False, rngs))
    self.conv1d = Weight(nnx.initializers.normal(0.02)(rngs.params(), (m.conv_dim, 1, m.conv_kernel), pd))
    self.dt_bias = nnx.Param(jnp.ones((h,), pd))
    # transformers draws A = exp(A_log) from [0.01, 16]: evenly spread over [1, 16] here, deterministic
    self.A_log = nnx.Param(jnp.asarray(np.log(np.linspace(1.0, 16.0, h)), pd))
    self.norm = Weight(jnp.ones((m.head_v_dim,), pd))
    self.out_proj = linear(cfg, m.value_dim, d, False, rngs)

  def tensors(self) -> dict:
    """The layer's tensors under transformers' names and layouts (`gated_deltanet_mixer`'s params)."""
    t = lambda proj: proj.kernel[...].T
    return {
      **{f"{name}.weight": t(getattr(self, name)) for name in self.projections},
      "conv1d.weight": self.conv1d.weight[...],
      "dt_bias": self.dt_bias[...],
      "A_log": self.A_log[...],
      "norm.weight": self.norm.weight[...],
      "out_proj.weight": t(self.out_proj),
    }

  def __call__(self, x_BxSxD: jax.Array, cache=None):
    state = None if cache is None else {"conv": cache[0], "recurrent": cache[1]}
    y_BxSxD, new = gated_deltanet_mixer(self.tensors(), x_BxSxD, self.mixer_cfg, state)
    if cache is None:
      return y_BxSxD
    return y_BxSxD, (new["conv"].astype(cache[0].dtype), new["recurrent"].astype(cache[1].dtype))


def cache_specs(cfg, batch: int, length: int) -> tuple[tuple[tuple, str], tuple[tuple, str]]:
  """((shape, dtype) of the convolution's inputs [B, kernel - 1, conv_dim], of the state [B, H, K, V] float32): no
  sequence axis, so `length` is unused."""
  del length
  m = deltanet_config(cfg)
  conv = ((batch, m.conv_kernel - 1, m.conv_dim), cfg.dtype)
  return conv, ((batch, m.num_v_heads, m.head_k_dim, m.head_v_dim), "float32")
