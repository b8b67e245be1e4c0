"""`MoEConfig`, the one description of an MoE layer, and up-front validation of experiment configs.

Every check runs in plain Python before anything is traced or compiled, and a failure names the
field, its value and what is allowed.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

ROUTINGS = ("topk",)
TRANSPORTS = ("ragged", "padded", "capacity", "hierarchical")
EXPERT_BACKENDS = ("ragged_dot", "dense", "pallas")
ACTIVATIONS = ("gelu", "relu", "silu")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
  """A bad config field or input; `field` names it where there is one."""

  def __init__(self, message: str, field: str | None = None, value: Any = None, allowed: str | None = None):
    super().__init__(message)
    self.field, self.value, self.allowed = field, value, allowed


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
  """Raises ConfigError naming `field`, its `value` and what is `allowed` unless `ok`."""
  if not ok:
    raise ConfigError(f"config field {field}={value!r} is not allowed: {allowed}", field, value, allowed)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE layer.

  num_experts: E, the global number of experts (a multiple of the mesh's device count).
  top_k: k, experts per token.
  d_model, d_ff: model and expert hidden widths.
  routing: 'topk' (flat softmax top-k: Switch k=1, GShard k=2, any k <= E).
  transport: 'ragged' (jax.lax.ragged_all_to_all; GPU/TPU), 'padded' (same semantics from fixed-size
    all_to_all; runs anywhere), 'capacity' (GShard/Switch dense dispatch; needs capacity_factor),
    'hierarchical' (flat routing, exchanged in two hops: over 'gpu', then over 'node').
  expert_backend: 'ragged_dot' (jax.lax.ragged_dot), 'dense' (per-expert loop; reference speed),
    'pallas' (moejax.kernels).
  capacity_factor: None = dropless; else each device sends each expert at most
    ceil(capacity_factor * local_tokens * k / E) token-choices, dropping the rest by priority
    (all first choices before any second choice; within a choice rank, earlier tokens first).
  renormalize: combine weights are the top-k probabilities divided by their sum (else raw).
  load_balance_coef: alpha of the Switch loss alpha * E * sum_e f_e * P_e.
  z_loss_coef: coefficient of the router z-loss mean(logsumexp(logits)^2).
  jitter: multiplicative router-input noise x * U(1 - jitter, 1 + jitter) in training; 0 = off.
  dtype: compute dtype of the expert matmuls ('float32' or 'bfloat16'; accumulation is fp32).
  """

  num_experts: int
  top_k: int
  d_model: int
  d_ff: int
  routing: str = "topk"
  transport: str = "padded"
  expert_backend: str = "ragged_dot"
  capacity_factor: float | None = None
  activation: str = "gelu"
  gated: bool = False
  renormalize: bool = False
  load_balance_coef: float = 0.01
  z_loss_coef: float = 0.0
  jitter: float = 0.0
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("num_experts", "top_k", "d_model", "d_ff"):
      value = getattr(self, name)
      require(_is_int(value) and value >= 1, name, value, "a positive int")
    require(self.top_k <= self.num_experts, "top_k", self.top_k, f"at most num_experts={self.num_experts}")
    require(self.routing in ROUTINGS, "routing", self.routing, f"one of {ROUTINGS}")
    require(self.transport in TRANSPORTS, "transport", self.transport, f"one of {TRANSPORTS}")
    require(self.expert_backend in EXPERT_BACKENDS, "expert_backend", self.expert_backend,
            f"one of {EXPERT_BACKENDS}")
    require(self.activation in ACTIVATIONS, "activation", self.activation, f"one of {ACTIVATIONS}")
    require(isinstance(self.gated, bool), "gated", self.gated, "True or False")
    require(isinstance(self.renormalize, bool), "renormalize", self.renormalize, "True or False")
    require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
    cf = self.capacity_factor
    require(cf is None or (isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf > 0),
            "capacity_factor", cf, "None (dropless) or a number > 0")
    require(self.transport != "capacity" or cf is not None, "capacity_factor", cf,
            "a number > 0 when transport='capacity' (dense dispatch has fixed capacity)")
    for name in ("load_balance_coef", "z_loss_coef"):
      value = getattr(self, name)
      require(isinstance(value, (int, float)) and value >= 0, name, value, "a number >= 0")
    require(isinstance(self.jitter, (int, float)) and 0 <= self.jitter < 1, "jitter", self.jitter, "in [0, 1)")

  @classmethod
  def from_mapping(cls, fields: Mapping[str, Any], prefix: str = "") -> "MoEConfig":
    """Builds from a dict or ConfigDict (e.g. `config.moe` with prefix 'moe.'), rejecting unknown
    fields by name; errors name the field with `prefix`."""
    known = {f.name for f in dataclasses.fields(cls)}
    fields = dict(fields)
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ConfigError(f"unknown config field(s) {[prefix + u for u in unknown]}; known: {sorted(known)}")
    try:
      return cls(**fields)
    except ConfigError as e:
      if e.field is None:
        raise
      require(False, prefix + e.field, e.value, e.allowed)

  def check_mesh(self, num_devices: int) -> int:
    """Returns experts_per_gpu for a mesh of `num_devices`, or raises naming num_experts."""
    require(self.num_experts % num_devices == 0, "num_experts", self.num_experts,
            f"a multiple of the mesh's {num_devices} devices (expert e lives on device e // experts_per_gpu)")
    return self.num_experts // num_devices
