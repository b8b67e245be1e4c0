"""Steps that must not change the model: a non-finite loss or gradient norm, and (optionally) a loss spike.

The train section (`train.max_nonfinite_steps`, `train.loss_spike_factor`; absent: DEFAULTS). Inside the jitted step
(`kept_unless_applied`) a step whose loss or global gradient norm (before clipping) is NaN or infinite, or, with
loss_spike_factor k > 0, whose loss exceeds k x the median of the last WINDOW applied steps' losses, is skipped: the
parameters, the optimizer state (its moments, counts and master copy) and the balancing biases stay bit for bit as
they were. The step's metrics say so (`skipped`, `nonfinite`); the host (`SkipCounter`, in `moejax.train.loop`)
counts the skipped steps and stops the run after max_nonfinite_steps of them in a row (0: never).

Why not `optax.apply_if_finite`: it looks at the gradients only (not the loss), adds its counters to the optimizer
state (every existing checkpoint would no longer restore), and applies zero updates rather than none (p + 0 turns a
-0.0 into +0.0, and with a master copy the cast runs again); a select between the old and new trees does neither.
"""

import jax
import jax.numpy as jnp

from moejax.validation import is_int, is_number, require

CONFIG_FIELDS = ("max_nonfinite_steps", "loss_spike_factor")
DEFAULTS = {"max_nonfinite_steps": 5, "loss_spike_factor": 0.0}
# The loss-spike window: the last WINDOW applied steps' losses, kept in the train state ('loss_window' [WINDOW]
# float32, NaN where not yet filled) rather than on the host, because the step must judge its own loss before its
# update is applied, and the host sees a step's loss only after the next step is already running. Small, so the
# median follows the falling loss of early training; a spike is judged only once it is full.
WINDOW = 16
KEPT = ("params", "opt_state", "expert_bias")  # what a skipped step leaves as it was


class TrainingStopped(RuntimeError):
  """Too many skipped steps in a row: the run stopped (one line: the step, why, the last checkpoint, the fix)."""


def settings(config) -> dict:
  """The train section's fields, DEFAULTS for those it lacks (or for a config without one)."""
  section = config.get("train") or {}
  return {name: section.get(name, default) for name, default in DEFAULTS.items()}


def validate_config(section, prefix: str = "") -> None:
  """Checks the train section (fields CONFIG_FIELDS); errors name the field with `prefix` (e.g. 'train.')."""
  limit, factor = (section.get(name, DEFAULTS[name]) for name in CONFIG_FIELDS)
  require(is_int(limit, 0), prefix + "max_nonfinite_steps", limit, "an int >= 0 (0: never stop)")
  require(
    is_number(factor) and (factor == 0 or factor > 1),
    prefix + "loss_spike_factor",
    factor,
    "0 (off) or a number > 1 (skip a step whose loss exceeds it x the median of recent losses)",
  )


def empty_window() -> jax.Array:
  """The loss-spike window before any step: [WINDOW] float32 NaN."""
  return jnp.full((WINDOW,), jnp.nan, jnp.float32)


def kept_unless_applied(old: dict, new: dict, metrics: dict, spike_factor: float) -> tuple[dict, dict]:
  """(state, metrics): `new` (the step's state), with KEPT taken from `old` (the state before it) where the step is
  skipped, and the step's metrics with `skipped` and `nonfinite` (bool scalars). With spike_factor > 0 the state's
  'loss_window' [WINDOW] takes the loss of an applied step."""
  loss = metrics["loss"]
  finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
  applied = finite
  if spike_factor > 0:
    window = old["loss_window"]
    full = jnp.all(jnp.isfinite(window))
    median = jnp.median(jnp.where(full, window, 0.0))
    applied = finite & ~(full & (loss > spike_factor * median))
    rolled = jnp.roll(window, -1).at[-1].set(loss.astype(jnp.float32))
    new = {**new, "loss_window": jnp.where(applied, rolled, window)}
  for name in KEPT:
    if name in new:
      new[name] = jax.tree.map(lambda n, o: jnp.where(applied, n, o), new[name], old[name])
  return new, {**metrics, "skipped": ~applied, "nonfinite": ~finite}


REASONS = {"nonfinite": "non-finite loss or gradient norm", "loss_spike": "loss spike"}  # a record's skip_reason


class SkipCounter:
  """The host's count of skipped steps (`total`, kept in checkpoints), the current run of them in a row, and the
  last step applied; `observe` adds each step's record and raises TrainingStopped at `limit` in a row (0: never)."""

  def __init__(self, limit: int, total: int = 0, last_applied: int = 0):
    self.limit, self.total, self.in_a_row, self.last_applied = limit, total, 0, last_applied

  def observe(self, record: dict, checkpoint: tuple[int, str] | None) -> None:
    """Counts `record` (a step's, with `skipped`) and adds `skipped_steps` (the running count) to it.
    checkpoint: (step, directory) of the newest checkpoint (None: none yet), for the stop's message."""
    if record.get("skipped"):
      self.total, self.in_a_row = self.total + 1, self.in_a_row + 1
    else:
      self.in_a_row, self.last_applied = 0, record["step"]
    record["skipped_steps"] = self.total
    if self.limit and self.in_a_row >= self.limit:
      raise TrainingStopped(self._message(record, checkpoint))

  def _message(self, record: dict, checkpoint) -> str:
    where = (
      f"the last checkpoint, step {checkpoint[0]} in {checkpoint[1]}, holds the parameters of step "
      f"{self.last_applied} (the last step applied) and resumes when run again"
      if checkpoint
      else "no checkpoint was written yet"
    )
    spike = ", raise train.loss_spike_factor" if record["skip_reason"] == "loss_spike" else ""
    return (
      f"step {record['step']}: {self.in_a_row} steps in a row skipped ({REASONS[record['skip_reason']]}: loss "
      f"{record['loss']:.4g}, |g| {record['grad_norm']:.4g}), so training stopped; {where}. Fix the cause (e.g. a "
      f"lower optim.learning_rate, the data){spike} or set train.max_nonfinite_steps higher (0: never stop)"
    )
