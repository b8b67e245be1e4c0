"""The checks of `MoEConfig`'s plain fields: their types and ranges, and the rules between fields that no choice
(routing, path, collective, schedule, expert sharding, expert backend) owns. Each failure names the field, its
value and what is allowed."""

import logging

from moejax.moe.experts import GATED_ONLY
from moejax.validation import is_int, is_number, require

# The one field `transport` that path and collective were before: each old value as (path, collective).
TRANSPORT_ALIASES = {
  "ragged": ("flat", "ragged"),
  "padded": ("flat", "padded"),
  "capacity": ("flat", "capacity"),
  "hierarchical": ("gpu_first", "auto"),
  "bilevel": ("node_first", "auto"),
}


def read_transport(transport: str, paths: tuple, collectives: tuple) -> tuple[str, str]:
  """(path, collective) of the old field `transport` (`TRANSPORT_ALIASES`), with a one-line notice."""
  require(
    transport in TRANSPORT_ALIASES,
    "transport",
    transport,
    f"one of {tuple(TRANSPORT_ALIASES)} (the old field; now path {paths} and collective {collectives})",
  )
  path, collective = TRANSPORT_ALIASES[transport]
  logging.getLogger("moejax.moe.config").warning(
    "transport=%r is read as path=%r, collective=%r (the old name of the two)", transport, path, collective
  )
  return path, collective


def check(cfg) -> None:
  """Raises ConfigError naming the first field of `cfg` whose value is of the wrong type or out of range."""
  _check_groups(cfg)
  for name in ("gated", "renormalize", "shared_gate", "expert_data_parallel", "ffn_bias", "router_bias"):
    require(isinstance(getattr(cfg, name), bool), name, getattr(cfg, name), "True or False")
  _check_gpt_oss_experts(cfg)
  _check_weight_inputs(cfg)
  require(cfg.dedup in (None, True, False), "dedup", cfg.dedup, "None, True or False")
  require(is_int(cfg.num_chunks), "num_chunks", cfg.num_chunks, "a positive int")
  require(
    isinstance(cfg.esp_cost, str) and cfg.esp_cost,
    "esp_cost",
    cfg.esp_cost,
    "a topology preset name or the path of a bench_collectives JSON record",
  )
  require(
    is_number(cfg.routed_scaling) and cfg.routed_scaling > 0, "routed_scaling", cfg.routed_scaling, "a number > 0"
  )
  floor = cfg.renormalize_min
  require(is_number(floor) and floor >= 0, "renormalize_min", floor, "a number >= 0")
  rate = cfg.bias_update_rate
  require(is_number(rate) and rate >= 0, "bias_update_rate", rate, "a number >= 0")
  _check_shared_and_replicas(cfg)
  for name, none in (("capacity_factor", "dropless"), ("buffer_factor", "worst-case receive buffers")):
    value = getattr(cfg, name)
    require(value is None or (is_number(value) and value > 0), name, value, f"None ({none}) or a number > 0")
  require(is_number(cfg.z_loss_coef) and cfg.z_loss_coef >= 0, "z_loss_coef", cfg.z_loss_coef, "a number >= 0")
  for name in ("load_balance_coef", "local_balance_coef"):
    value = getattr(cfg, name)
    require(
      value is None or is_number(value) and value >= 0, name, value, "a number >= 0, or None for the paper's value"
    )
  require(isinstance(cfg.jitter, (int, float)) and 0 <= cfg.jitter < 1, "jitter", cfg.jitter, "in [0, 1)")


def _check_groups(cfg) -> None:
  """Group-limited routing's groups: dividing the experts, at most all of them kept."""
  require(
    cfg.num_groups is None or (is_int(cfg.num_groups) and cfg.num_experts % cfg.num_groups == 0),
    "num_groups",
    cfg.num_groups,
    f"None or a positive int dividing num_experts={cfg.num_experts}",
  )
  if cfg.num_groups is not None:
    require(
      is_int(cfg.topk_groups) and cfg.topk_groups <= cfg.num_groups,
      "topk_groups",
      cfg.topk_groups,
      f"an int in [1, num_groups={cfg.num_groups}]",
    )


def _check_weight_inputs(cfg) -> None:
  """Weights on the experts' inputs (Llama 4): the layer runs each choice's row through its expert scaled by the
  weight where the weights arrive with the rows (`local_experts.Experts.weighted`), which every path, collective,
  sharding and the sequential and chunked schedules share; a dropped choice (weight 0) then outputs exactly zero only
  without expert biases."""
  require(isinstance(cfg.weight_inputs, bool), "weight_inputs", cfg.weight_inputs, "True or False")
  if not cfg.weight_inputs:
    return
  require(
    not cfg.ffn_bias, "ffn_bias", cfg.ffn_bias, "False with weight_inputs (a zero weight must give a zero output)"
  )  # the schedule's own rule: `schedule.Schedule.check`


def _check_gpt_oss_experts(cfg) -> None:
  """The clamped SwiGLUs (gpt-oss's, DeepSeek-V4's): gated activations, with positive alpha and limit."""
  require(
    cfg.activation not in GATED_ONLY or cfg.gated,
    "gated",
    cfg.gated,
    f"True with activation={cfg.activation!r} (a function of the gate and up projections)",
  )
  for name in ("swiglu_alpha", "swiglu_limit"):
    require(is_number(getattr(cfg, name)) and getattr(cfg, name) > 0, name, getattr(cfg, name), "a number > 0")


def _check_shared_and_replicas(cfg) -> None:
  """The shared experts, the expert table and the slot tables' replication and re-planning."""
  for name, none in (("shared_d_ff", "d_ff"), ("slots_per_device", "no replication")):
    value = getattr(cfg, name)
    require(value is None or is_int(value), name, value, f"None ({none}) or a positive int")
  for name, low in (("replan_every", 0), ("replan_window", 1), ("num_shared_experts", 0)):
    require(is_int(getattr(cfg, name), low), name, getattr(cfg, name), f"an int >= {low}")
  require(
    not cfg.shared_gate or cfg.num_shared_experts > 0,
    "shared_gate",
    cfg.shared_gate,
    "False without shared experts (num_shared_experts=0)",
  )
  require(
    cfg.expert_table is None or isinstance(cfg.expert_table, str),
    "expert_table",
    cfg.expert_table,
    "None (the table shipped for the device) or the path of a measured expert-backend table",
  )
  require(
    cfg.replan_every == 0 or cfg.slots_per_device is not None,
    "replan_every",
    cfg.replan_every,
    "0 unless slots_per_device is set (re-planning moves replicas between slots)",
  )
