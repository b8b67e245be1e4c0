"""Checkpoints: orbax CheckpointManager, periodic, asynchronous, keep-last-N, atomic.

A checkpoint holds the train state (params, optimizer state, step, RNG; sharded arrays) and a JSON
item with the host-side state (the training loop's: data iterators, re-plan window), a description of
the state's shapes, and a fingerprint of every array. Restoring walks back from the newest step: a
checkpoint that cannot be read, or whose arrays do not match their fingerprint, is reported, moved
aside (so the step can be saved again) and skipped; one written by a different config is an error,
never silently replaced. Inference restores a part of the state (`restore_latest(..., part=True)`: the
parameters, slot tables and balancing biases, not the optimizer state), checked the same way.
"""

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.metadata import array_metadata_store

from moejax.validation import ConfigError, is_int, require

CORRUPT_PREFIX = "corrupt-"
CONFIG_FIELDS = ("every_steps", "keep", "use_async", "resume", "branch_dir")
RESUME_MODES = ("same", "continue", "branch")  # resuming with a changed config: moejax.train.resume


def validate_config(c, prefix: str = "") -> None:
  """Checks the checkpoint section `c` (fields CONFIG_FIELDS); errors name the field with `prefix`
  (e.g. 'checkpoint.')."""
  require(is_int(c.every_steps), prefix + "every_steps", c.every_steps, "a positive int")
  require(is_int(c.keep), prefix + "keep", c.keep, "a positive int")
  require(isinstance(c.use_async, bool), prefix + "use_async", c.use_async, "True or False")
  require(c.resume in RESUME_MODES, prefix + "resume", c.resume, f"one of {RESUME_MODES}")
  require(
    isinstance(c.branch_dir, str) and (c.resume == "branch") == bool(c.branch_dir),
    prefix + "branch_dir",
    c.branch_dir,
    f"a directory with {prefix}resume='branch', else ''",
  )


def fingerprint(state, order=None) -> jax.Array:
  """uint32 checksum of every bit of every array of `state` (order-independent integer sums, so it
  is exact however the arrays are sharded); position-weighted, so moved values change it too.

  order: each leaf's index among the leaves of the whole state, when `state` is a part of it (default: its
  own); the fingerprints of the parts of a state add up (mod 2^32) to the whole state's."""

  def leaf_sum(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)

  leaves = jax.tree.leaves(state)
  order = range(len(leaves)) if order is None else order
  sums = [leaf_sum(x) * jnp.uint32(2 * i + 1) for i, x in zip(order, leaves)]
  return jnp.sum(jnp.stack(sums), dtype=jnp.uint32)


def describe(state) -> str:
  """The tree structure, shapes and dtypes of `state` (arrays or ShapeDtypeStructs)."""
  leaves = [
    f"{jax.tree_util.keystr(path)}:{x.dtype}{list(x.shape)}"
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
  ]
  return ";".join(leaves)


def _canonical(path: str) -> str:
  """A leaf's path written alike for the saved tree and orbax's metadata of it: a named tuple's attribute
  as a dict key, a dict key of digits as an index (orbax keeps every key as a string)."""
  return re.sub(r"\['(\d+)'\]", r"[\1]", re.sub(r"\.(\w+)", r"['\1']", path))


def _paths(state) -> list[str]:
  """Each leaf's path in `state` (`_canonical`)."""
  return [_canonical(jax.tree_util.keystr(path)) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _part_of(description: str, keys) -> str:
  """The entries of a state's `describe` under the top-level `keys`."""
  prefixes = tuple(f"[{k!r}]" for k in keys)
  return ";".join(entry for entry in description.split(";") if entry.startswith(prefixes))


def _paths_of_description(description: str) -> list[str]:
  """The leaf paths of a state's `describe` (`_canonical`)."""
  return [_canonical(entry.rsplit(":", 1)[0]) for entry in description.split(";")]


# Where a model's layers are in its state, by the value of model.scan_layers that lays them out so
# (`moejax.models.layers`): one entry per layer, or stacked per segment.
LAYER_LAYOUTS = {"['params']['blocks']": False, "['params']['segments']": True}


def _layer_layout_hint(saved, want: str) -> str:
  """The fix when a checkpoint's layers are laid out otherwise than the config's (e.g. a run from before scanned
  layers, which were unrolled, resumed with today's default scan_layers=True); '' otherwise."""
  layout = lambda description: next((scan for key, scan in LAYER_LAYOUTS.items() if key in description), None)
  had, wants = layout(saved if isinstance(saved, str) else ""), layout(want)
  if had is None or wants is None or had == wants:
    return ""
  name = lambda scan: "scanned (params/segments/...)" if scan else "unrolled (params/blocks/i/...)"
  return (
    f": its model's layers are {name(had)}, this config's {name(wants)}; set model.scan_layers={had} "
    f"(--config.model.scan_layers={had}) to resume it (runs from before scanned layers are unrolled)"
  )


_SPEC = re.compile(r"\s*\[tensorstore_spec=.*$")  # tensorstore's errors end with their whole spec as JSON


def readable(error: BaseException) -> str:
  """'Type: message' of the innermost error `error` was raised from (its __cause__, else its unsuppressed
  __context__), on one line: the message's first line, without tensorstore's spec, at most 300 characters. orbax
  wraps a damaged array file's read error in a bare Exception whose text is a pybind method's repr; the reason is
  the error it was raised from."""
  seen = {id(error)}
  while True:
    inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if inner is None or id(inner) in seen:
      break
    error = inner
    seen.add(id(error))
  line = _SPEC.sub("", (str(error).splitlines() or [""])[0])
  return f"{type(error).__name__}: {line[:300]}"


def _type_handlers():
  """orbax's default handlers, but jax.Arrays saved without replica-parallel writes: those slice every
  replicated array on device first, one compiled program per shape (a 2-step DeepSeek-V3-preset run spent
  3.8 s of its 12.8 s on them on CPU); orbax already leaves them off on GPU."""
  arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())
  return ocp.type_handlers.create_type_handler_registry(
    (jax.Array, arrays),
    *(
      (ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types() if ty is not jax.Array
    ),
  )


class Checkpointer:
  """Saves and restores (train state, host state) under `directory`; the host state is any JSON value.

  keep: the number of newest checkpoints kept. use_async: write in the background while training
  continues (the arrays are copied to host memory before `save` returns).
  """

  def __init__(self, directory: str, *, keep: int, use_async: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=use_async
    )
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={
        "state": ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
        "meta": ocp.JsonCheckpointHandler(),
      },
    )
    self._fingerprints = {}

  def _fingerprint(self, state, order=None) -> int:
    """The state's fingerprint, computed where its arrays live and replicated to every process."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    key = mesh if order is None else (mesh, tuple(order))
    if key not in self._fingerprints:
      self._fingerprints[key] = jax.jit(lambda s: fingerprint(s, order), out_shardings=NamedSharding(mesh, P()))
    return int(self._fingerprints[key](state))

  def save(self, step: int, state, host_state) -> None:
    meta = {"step": step, "data": host_state, "describe": describe(state), "fingerprint": self._fingerprint(state)}
    self.manager.save(
      step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)), force=True
    )

  def restore_latest(self, abstract_state, *, part: bool = False) -> tuple[int, object, object] | None:
    """(step, state, host state) of the newest intact checkpoint, or None if there is none.

    abstract_state: the state's tree of jax.ShapeDtypeStruct with shardings. part: it holds some of the
    saved state's top-level entries only, and only those are restored (the others are read as host
    arrays for the fingerprint, then dropped).
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      restored, problem = self._try_restore(step, abstract_state, part)
      ok = multihost_utils.process_allgather(np.int32(problem is None)) if jax.process_count() > 1 else [1]
      if problem is None and all(np.asarray(ok)):
        logging.info("restored checkpoint step %d from %s", step, self.directory)
        return restored
      problem = problem or "another process could not read it"
      message = f"checkpoint step {step} in {self.directory} is corrupt or incomplete ({problem}); skipping it"
      logging.warning(message)
      if jax.process_index() == 0:
        print(f"WARNING: {message}", flush=True)
      self._set_aside(step)
    return None

  def _try_restore(self, step: int, abstract_state, part: bool = False):
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      want = describe(abstract_state)
    except Exception as e:  # orbax raises many kinds of errors for unreadable files
      return None, f"metadata: {readable(e)}"
    saved = meta.get("describe")
    if (_part_of(saved, abstract_state) if part and isinstance(saved, str) else saved) != want:
      hint = _layer_layout_hint(saved, want)
      raise ConfigError(
        f"checkpoint step {step} in {self.directory} holds a state of another shape "
        f"than this config's{hint}; use another workdir.\n  checkpoint: {saved}"
        f"\n  config:     {want}",
        "model.scan_layers" if hint else None,
      )
    try:
      state = self.manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            abstract_state, ocp.checkpoint_utils.construct_restore_args(abstract_state), partial_restore=part
          )
        ),
      )["state"]
      got = self._fingerprint(state) if not part else self._part_fingerprint(step, state, saved)
    except Exception as e:
      return None, f"arrays: {readable(e)}"
    if got != meta["fingerprint"]:
      return None, f"fingerprint {got} differs from the saved {meta['fingerprint']}"
    return (step, state, meta["data"]), None

  def _part_fingerprint(self, step: int, state: dict, saved: str) -> int:
    """The whole saved state's fingerprint from a part of it restored (`state`) and the other top-level
    entries read as host arrays; each leaf weighted by its index in the saved state (`describe` order)."""
    tree = self.manager.item_metadata(step)["state"].tree
    others = {k: v for k, v in tree.items() if k not in state}
    host = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
          others, jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), others), partial_restore=True
        )
      ),
    )["state"]
    index = {path: i for i, path in enumerate(_paths_of_description(saved))}
    total = self._fingerprint(state, [index[p] for p in _paths(state)])
    if jax.tree.leaves(host):
      total += int(jax.jit(fingerprint, static_argnums=1)(host, tuple(index[p] for p in _paths(host))))
    return total % 2**32

  def _set_aside(self, step: int) -> None:
    """Moves a bad step's directory out of the manager's sight (kept for inspection)."""
    if jax.process_index() == 0:
      path = os.path.join(self.directory, str(step))
      if os.path.exists(path):
        os.rename(path, os.path.join(self.directory, f"{CORRUPT_PREFIX}{step}-{int(time.time())}"))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint set aside {step}")
    self.manager.reload()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
