"""This device's experts as a schedule runs them (`Experts`): its shard of the weights, the activation and the
backend, the whole FFN or its two halves, and the sum of expert sharding's d_ff-slice partial outputs."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe import experts


class Experts(NamedTuple):
  """This device's experts: weights w_in/w_gate [G, d, f], w_out [G, f, d], biases {'b_in', 'b_gate' [G, f],
  'b_out' [G, d]} (empty without ffn_bias; b_out only where this device adds it) and how to run them.
  partial_sum_over: a mesh axis whose devices hold d_ff slices of the same experts on the same rows
  (expert sharding's baseline): their partial outputs are summed over it."""

  w_in: jax.Array
  w_out: jax.Array
  w_gate: jax.Array | None
  activation: experts.Activation
  backend: str
  dtype: jnp.dtype
  partial_sum_over: str | None = None
  biases: dict = {}
  weight_inputs: bool = False  # `weighted`: the weights scale each row's input (Llama 4), not its output

  @classmethod
  def of(cls, params: dict, cfg, sharding=None) -> "Experts":
    """A layer's local experts from its parameters (this device's shard), config and expert sharding (None:
    whole experts)."""
    biases = {name: params[name] for name in ("b_in", "b_gate", "b_out") if name in params}
    if sharding is not None and "b_out" in biases:
      biases["b_out"] = sharding.out_bias(biases["b_out"])
    return cls(
      params["w_in"],
      params["w_out"],
      params.get("w_gate"),
      experts.Activation.of(cfg),
      cfg.expert_backend,
      jnp.dtype(cfg.dtype),
      None if sharding is None else sharding.partial_sum_over,
      biases,
      cfg.weight_inputs,
    )

  def _sum(self, y):
    return y if self.partial_sum_over is None else jax.lax.psum(y, self.partial_sum_over)

  def ffn(self, x_RxD, group_sizes_G):
    return self._sum(
      experts.expert_ffn(
        x_RxD,
        group_sizes_G,
        self.w_in,
        self.w_out,
        self.w_gate,
        activation=self.activation,
        backend=self.backend,
        dtype=self.dtype,
        biases=self.biases,
      )
    )

  def weighted(self, x_QxD, group_sizes_G, w_Q):
    """The FFN of rows [Q, d] weighted by w [Q] -> [Q, d] fp32: its output times the weight, or with weight_inputs
    of its input times the weight (a zero weight, a dropped choice's, still gives exactly zero: no biases)."""
    w_Qx1 = w_Q[:, None].astype(jnp.float32)
    if self.weight_inputs:
      return self.ffn((x_QxD.astype(jnp.float32) * w_Qx1).astype(x_QxD.dtype), group_sizes_G).astype(jnp.float32)
    return self.ffn(x_QxD, group_sizes_G) * w_Qx1

  def hidden(self, x_RxD, group_sizes_G):
    return experts.expert_hidden(
      x_RxD,
      group_sizes_G,
      self.w_in,
      self.w_gate,
      activation=self.activation,
      backend=self.backend,
      dtype=self.dtype,
      b_in_GxF=self.biases.get("b_in"),
      b_gate_GxF=self.biases.get("b_gate"),
    )

  def output(self, h_RxF, group_sizes_G, columns: slice):
    b_out = self.biases.get("b_out")
    return self._sum(
      experts.expert_output(
        h_RxF,
        group_sizes_G,
        self.w_out[:, :, columns],
        backend=self.backend,
        dtype=self.dtype,
        b_out_GxD=None if b_out is None else b_out[:, columns],
      )
    )
