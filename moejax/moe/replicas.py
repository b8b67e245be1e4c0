"""Running the layer on a slot table (Lina, DeepSeek EPLB): physical slots holding copies of experts.

slot_expert [A, Z]: the logical expert held by slot s of flat device d (from
`moejax.replication.rebalance`); physical slot p = d * Z + s lives on device d, so the exchange code
sees Z "experts per device". Each logical expert has one or more replicas; a token-choice goes to
one of them: device `me` sends its j-th row for expert e (rows in order) to replica (j + me) mod c_e
of the c_e replicas, so every source splits an expert's rows evenly (within one row) and the sources
start at different replicas. The weights of the physical slots are gathered from the logical ones,
so gradients of replicas sum back onto their expert.
"""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe import plan as plan_lib
from moejax.moe.params import EXPERT_PARAMS as EXPERT_WEIGHTS  # weights and biases, copied per slot
from moejax.validation import ConfigError


def check_slot_table(slot_expert, num_experts: int, devices: int, holder: str = "devices") -> int:
  """Returns Z (slots per holder) of slot_expert [A, Z], or raises naming what is wrong; the contents
  are checked when the table is concrete (not traced)."""
  shape = tuple(np.shape(slot_expert))
  if len(shape) != 2 or shape[0] != devices or shape[1] < 1:
    raise ConfigError(
      f"slot_expert has shape {shape}; expected [{devices} {holder}, slots per holder]",
      "slot_expert",
      shape,
      f"[{devices}, Z]",
    )
  if not jnp.issubdtype(jnp.asarray(slot_expert).dtype, jnp.integer):
    raise ConfigError(f"slot_expert must hold integer expert ids, got {jnp.asarray(slot_expert).dtype}")
  if not isinstance(slot_expert, jax.core.Tracer):
    table = np.asarray(slot_expert)
    if table.min() < 0 or table.max() >= num_experts:
      raise ConfigError(
        f"slot_expert holds ids {table.min()}..{table.max()}, outside [0, {num_experts})",
        "slot_expert",
        (int(table.min()), int(table.max())),
        f"ids in [0, {num_experts})",
      )
    missing = np.setdiff1d(np.arange(num_experts), table)
    if missing.size:
      raise ConfigError(
        f"experts {missing.tolist()} have no slot in slot_expert (every expert needs one)",
        "slot_expert",
        missing.tolist(),
        "every expert at least once",
      )
  return shape[1]


def initial_table(num_experts: int, holders: int, slots: int) -> np.ndarray:
  """[A, Z] int32: holder h keeps its experts h * E / A .. in its first slots and, in its spare slots,
  replicas of the experts of the holders after it (never its own); the table a run starts from before
  any load has been measured."""
  per, spare = num_experts // holders, slots - num_experts // holders
  return np.array(
    [
      [h * per + j for j in range(per)] + [(h * per + per + j) % num_experts for j in range(spare)]
      for h in range(holders)
    ],
    np.int32,
  )


def physical_params(params: dict, slot_expert) -> dict:
  """The expert weights and biases laid out per physical slot ([A * Z, ...] copies); routers unchanged."""
  slots = jnp.asarray(slot_expert).reshape(-1)
  return {name: jnp.take(value, slots, axis=0) if name in EXPERT_WEIGHTS else value for name, value in params.items()}


def to_slots(ids_R, slot_expert_flat, num_experts: int, me):
  """[R] physical slot of each row's logical expert (-1 stays -1): the (j + me) mod c_e-th replica
  for the j-th row of expert e."""
  key_R = jnp.where(ids_R >= 0, ids_R, num_experts)
  rank_R = plan_lib.rank_in_group(key_R, num_experts)
  slots_by_expert = jnp.argsort(slot_expert_flat, stable=True)  # slots grouped by their expert
  replicas = plan_lib.histogram(slot_expert_flat, num_experts)
  start = plan_lib.exclusive_cumsum(replicas)
  e = jnp.minimum(key_R, num_experts - 1)
  slot_R = slots_by_expert[start[e] + (rank_R + me) % jnp.maximum(replicas[e], 1)]
  return jnp.where(ids_R >= 0, slot_R, -1)


def to_experts(slot_ids_R, slot_expert_flat):
  """[R] logical expert of each physical slot id (-1 stays -1)."""
  return jnp.where(slot_ids_R >= 0, slot_expert_flat[jnp.maximum(slot_ids_R, 0)], -1)
