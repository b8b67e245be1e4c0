"""The optimizers, after global-norm clipping, with warm-up and decay: SMILE's LAMB, AdamW (the decoder families'),
and Muon on the matrices (Kimi K2's), each optionally on an fp32 master copy with moments in a chosen dtype
(`moejax.train.precision`).

LAMB is assembled from optax's pieces as in `optax.lamb` (Adam moments, decoupled weight decay,
layer-wise trust ratio, learning rate), except that the trust ratio of an expert tensor [E, ...] is
taken per expert: each expert is its own parameter, as in implementations that keep one weight per
expert, so one expert's norm never scales another's update. Muon likewise orthogonalises each expert's
matrix [d, f] of a stacked [E, d, f] on its own.
"""

import inspect

import jax
import jax.numpy as jnp
import optax

from moejax.models import sharding as sharding_lib
from moejax.train import precision
from moejax.validation import is_int, is_number, require

DECAYS = ("linear", "cosine")
NAMES = ("lamb", "adamw", "muon")
MASTER_DTYPES = (None, "float32")
MOMENT_DTYPES = (None, "float32", "bfloat16")
CONFIG_FIELDS = (
  "name",
  "learning_rate",
  "warmup_steps",
  "decay",
  "decay_steps",
  "end_fraction",
  "b1",
  "b2",
  "eps",
  "weight_decay",
  "clip_norm",
  "master_dtype",
  "moment_dtype",
)
# What a section that predates these fields means (today's optimizer): SMILE's LAMB on the parameters themselves.
DEFAULTS = {"name": "lamb", "master_dtype": None, "moment_dtype": None}
# Muon's update scaled to this RMS per matrix (Moonlight's and Kimi K2's match of AdamW's update RMS), so AdamW's
# learning rate and weight decay carry over; optax.contrib.muon takes it from optax 0.2.7 on.
MUON_RMS = 0.2
MUON_OPTAX = "0.2.7"
# Top-level parameters that are tables or the output head, not matrices of a layer: AdamW under 'muon'.
NOT_MUON = ("embed", "pos_embed", "lm_head")


def validate_config(o, prefix: str = "") -> None:
  """Checks the optim section `o` (fields CONFIG_FIELDS); errors name the field with `prefix`
  (e.g. 'optim.')."""
  require(is_number(o.learning_rate) and o.learning_rate > 0, prefix + "learning_rate", o.learning_rate, "> 0")
  require(is_int(o.warmup_steps, 0), prefix + "warmup_steps", o.warmup_steps, "an int >= 0")
  require(o.decay in DECAYS, prefix + "decay", o.decay, f"one of {DECAYS}")
  require(is_int(o.decay_steps, 0), prefix + "decay_steps", o.decay_steps, "an int >= 0 (0: steps)")
  require(is_number(o.end_fraction) and 0 <= o.end_fraction <= 1, prefix + "end_fraction", o.end_fraction, "in [0, 1]")
  for name in ("b1", "b2"):
    require(is_number(o[name]) and 0 <= o[name] < 1, prefix + name, o[name], "in [0, 1)")
  for name in ("eps", "clip_norm"):
    require(is_number(o[name]) and o[name] > 0, prefix + name, o[name], "> 0")
  require(is_number(o.weight_decay) and o.weight_decay >= 0, prefix + "weight_decay", o.weight_decay, ">= 0")
  require(o.name in NAMES, prefix + "name", o.name, f"one of {NAMES}")
  require(
    o.name != "muon" or has_muon(),
    prefix + "name",
    o.name,
    f"'lamb' or 'adamw': 'muon' needs optax >= {MUON_OPTAX} (this is optax {optax.__version__})",
  )
  require(
    o.master_dtype in MASTER_DTYPES,
    prefix + "master_dtype",
    o.master_dtype,
    "None (the parameters updated in their own dtype) or 'float32' (an fp32 master copy)",
  )
  require(
    o.moment_dtype in MOMENT_DTYPES,
    prefix + "moment_dtype",
    o.moment_dtype,
    "None (the dtype of what is updated: the master or the parameters), 'float32' or 'bfloat16'",
  )


def has_muon() -> bool:
  """Whether this optax has optax.contrib.muon with per-tensor dimension numbers and consistent_rms (0.2.7 on)."""
  contrib = getattr(optax, "contrib", None)
  muon = getattr(contrib, "muon", None)
  return muon is not None and "consistent_rms" in inspect.signature(muon).parameters


def warmup_then_decay(
  peak: float, warmup_steps: int, total_steps: int, decay: str = "linear", end_fraction: float = 0.0
) -> optax.Schedule:
  """Linear warm-up over `warmup_steps` (the first update already uses peak / warmup_steps), then
  linear or cosine decay to `end_fraction * peak` at `total_steps`."""

  def learning_rate(count):
    warm = jnp.minimum(1.0, (count + 1) / max(warmup_steps, 1))
    progress = jnp.clip((count - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
    if decay == "linear":
      fall = 1.0 - progress
    else:
      fall = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return peak * warm * (end_fraction + (1.0 - end_fraction) * fall)

  return learning_rate


def scale_by_trust_ratio(separate) -> optax.GradientTransformation:
  """LAMB's trust ratio |param| / |update|, over each whole tensor, or per slice [i, ...] of a tensor's leading axes
  that index separate tensors (`separate`: a tree like the params of their counts, `sharding.separate_axes`: a
  scanned segment's layers, the routed experts); 1 where either norm is 0."""

  def update_fn(updates, state, params):
    def scale(u, p, lead):
      axes = tuple(range(lead, p.ndim)) if lead else None
      p_norm = jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axis=axes, keepdims=True))
      u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=axes, keepdims=True))
      ratio = jnp.where((p_norm > 0) & (u_norm > 0), p_norm / jnp.where(u_norm > 0, u_norm, 1.0), 1.0)
      return (u * ratio).astype(u.dtype)

    return jax.tree.map(scale, updates, params, separate), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _decay_mask(params):
  """Weight decay on matrices only: vectors (biases, norms; a scanned segment's stacked ones too) are not decayed, as
  in BERT."""
  return jax.tree.map(lambda p, lead: p.ndim - lead >= 2, params, sharding_lib.separate_axes(params))


def lamb(
  learning_rate: optax.ScalarOrSchedule,
  separate,
  *,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-6,
  weight_decay: float = 0.01,
  clip_norm: float = 1.0,
  mu_dtype=None,
) -> optax.GradientTransformation:
  """Clip by global norm, then LAMB. Weight decay skips vectors (biases, LayerNorm), as in BERT."""
  return optax.chain(
    optax.clip_by_global_norm(clip_norm),
    optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype),
    optax.add_decayed_weights(weight_decay, mask=_decay_mask),
    scale_by_trust_ratio(separate),
    optax.scale_by_learning_rate(learning_rate),
  )


def muon_dimensions(params):
  """A function of a params-like tree -> Muon's dimension numbers per leaf: every matrix [d, f] but the tables and
  head (`NOT_MUON`) on its own, after the leading axes that index separate tensors (`sharding.separate_axes`: each
  routed expert's of a stacked [E, d, f], each layer's of a scanned segment's [repeats, ...]), None (AdamW) for the rest.
  It maps over the tree it is given, so optax.tree_map_params' stand-in tree passes."""
  separate = dict(jax.tree_util.tree_flatten_with_path(sharding_lib.separate_axes(params))[0])
  dims = optax.contrib.MuonDimensionNumbers

  def rule(path, x):
    lead, top = separate.get(path, 0), getattr(path[0], "key", None)
    return dims(reduction_axis=lead, output_axis=lead + 1) if x.ndim - lead == 2 and top not in NOT_MUON else None

  return lambda tree: jax.tree_util.tree_map_with_path(rule, tree)


def optimizer(o, learning_rate: optax.Schedule, params) -> optax.GradientTransformation:
  """The optim section's optimizer for `params` (arrays or ShapeDtypeStructs: only their tree and shapes are read),
  after clipping by global norm (clip_norm), by o.name: 'lamb' (`lamb`: per-expert trust ratios), 'adamw'
  (optax.adamw, weight decay on matrices only) or 'muon' (optax.contrib.muon with momentum b1 on `muon_dimensions`'
  matrices, its update RMS matched to AdamW's, and AdamW on the rest, every tensor decayed). With o.moment_dtype,
  the moments are kept in it; with o.master_dtype, the optimizer updates an fp32 master copy in its state
  (`moejax.train.precision`; the step applies it with `precision.apply`). Fields missing from `o` take DEFAULTS."""
  get = lambda name: o.get(name, DEFAULTS[name])
  name, master, moments = get("name"), get("master_dtype"), get("moment_dtype")
  mu_dtype = jnp.dtype(moments) if moments else None
  if name == "lamb":
    tx = lamb(
      learning_rate,
      sharding_lib.separate_axes(params),
      b1=o.b1,
      b2=o.b2,
      eps=o.eps,
      weight_decay=o.weight_decay,
      clip_norm=o.clip_norm,
      mu_dtype=mu_dtype,
    )
  elif name == "adamw":
    tx = optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      optax.adamw(
        learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, mu_dtype=mu_dtype, weight_decay=o.weight_decay, mask=_decay_mask
      ),
    )
  else:
    tx = optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      optax.contrib.muon(
        learning_rate,
        beta=o.b1,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mu_dtype=mu_dtype,
        adam_b1=o.b1,
        adam_b2=o.b2,
        adam_weight_decay=o.weight_decay,
        muon_weight_dimension_numbers=muon_dimensions(params),
        consistent_rms=MUON_RMS,
      ),
    )
  if moments:
    tx = precision.moments_in(tx, jnp.dtype(moments))
  return precision.with_master(tx, jnp.dtype(master)) if master else tx
