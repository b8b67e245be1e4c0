"""How one layer call spreads over the mesh (`Layout`), and the checks of a call's inputs before tracing."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.moe import collective as collective_lib
from moejax.moe import expert_sharding as esp_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe.config import MoEConfig
from moejax.moe.expert_parallel import ExpertParallel
from moejax.moe.params import param_shapes
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.validation import ConfigError, require


class Layout(NamedTuple):
  """How one layer call spreads over the mesh, fixed before tracing (`layout`).

  sharding: the expert sharding (`moe.expert_sharding`: which tokens a device routes, which rows it sends,
    how the returned rows are finished); slots: Z, expert slots per holder (E / holders, or a slot table's
    width; holders: `MoEConfig.expert_holders`); tokens: the tokens one device routes (one dispatch group:
    capacity counts within it); rows: the rows one device sends (tokens with dedup, else token-choices, before
    the Dump's copies); hops: the path's hops; collective: what moves each hop's rows (resolved for the platform;
    'capacity' with a flat hop's block rows); buffer_rows: the per-hop receive bound
    (None: the worst case); dedup: one row per destination of each hop (`moe.path`); wire: the rows' dtypes
    to the experts and back (`moe.wire`; None: their own).
  """

  n: int
  m: int
  sharding: ExpertParallel
  slots: int
  tokens: int
  rows: int
  hops: tuple
  collective: collective_lib.Collective
  buffer_rows: int | None
  dedup: bool
  wire: tuple

  @property
  def x_spec(self) -> P:
    """The sharding of x and y."""
    return P(self.sharding.x_axes)


def _require_concrete_backend(cfg: MoEConfig) -> None:
  require(
    not cfg.backend_kind.needs_resolving,
    "expert_backend",
    cfg.expert_backend,
    "a concrete backend: resolve 'auto' when the "
    "config is made (moejax.cost.expert_backend.resolve(cfg, tokens, nodes, gpus_per_node); the trainer does)",
  )


def layout(cfg: MoEConfig, tokens: int, mesh: jax.sharding.Mesh, slots: int | None = None) -> Layout:
  """The layer's layout for `tokens` global tokens on `mesh`; slots: a slot table's width (None: none).
  Raises ConfigError naming the field where the pieces cannot meet."""
  n, m = mesh_lib.axis_sizes(mesh)
  _require_concrete_backend(cfg)
  sharding = esp_lib.of(cfg)
  per_holder = cfg.experts_per_holder(n, m)
  slots = per_holder if slots is None else slots
  routed_tokens = tokens // sharding.token_groups(n, m)
  choices = sharding.send_rows(cfg, routed_tokens, m)
  rows = choices // cfg.choices_per_token if cfg.deduplicates else choices
  collective = cfg.collective_kind.resolve(platform_lib.of_mesh(mesh))
  if collective.fixed_blocks:  # a block per peer: every slot of the peer full, for each copy
    collective = collective._replace(block_rows=slots * sharding.dense_rows_per_slot(cfg, routed_tokens, m))
  return Layout(
    n,
    m,
    sharding,
    slots,
    routed_tokens,
    rows,
    sharding.hops(cfg),
    collective,
    collective_lib.buffer_bound(cfg.buffer_factor, choices * sharding.copies(m)),
    cfg.deduplicates,
    (cfg.dispatch_dtype, cfg.combine_dtype),
  )


def _check_params(params: dict, cfg: MoEConfig) -> None:
  """params: a dict whose arrays have the shapes of `param_shapes(cfg)`."""
  if not isinstance(params, dict):
    raise ConfigError(f"params must be a dict in the documented layout, got {type(params).__name__}")
  want = param_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if got != want:
    raise ConfigError(f"parameter shapes {got} do not match the layout for this config: {want}")


def _tokens_of(x: jax.Array, cfg: MoEConfig) -> int:
  """The global tokens of x, [tokens, d_model] or [batch, seq, d_model]; any other shape raises."""
  if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
    raise ConfigError(f"x has shape {x.shape}; expected [tokens, {cfg.d_model}] or [batch, seq, {cfg.d_model}]")
  return x.size // cfg.d_model


def _check_sequence_balance(cfg: MoEConfig, x: jax.Array, lay: Layout) -> None:
  """balance_loss='sequence' needs x [batch, seq, d] with whole sequences on each routing device."""
  if cfg.balance_loss == "sequence":
    require(
      x.ndim == 3 and lay.tokens % x.shape[1] == 0,
      "balance_loss",
      cfg.balance_loss,
      f"'batch' unless x is [batch, seq, d] with whole sequences on each routing device (x {x.shape}, "
      f"{lay.tokens} tokens routed per device)",
    )


def _check_expert_bias(cfg: MoEConfig, expert_bias) -> None:
  """expert_bias: None or [E + Z], one per expert the router scores (zero experts included)."""
  scored = cfg.router.scored
  if expert_bias is not None and tuple(np.shape(expert_bias)) != (scored,):
    raise ConfigError(
      f"expert_bias has shape {tuple(np.shape(expert_bias))}; expected [{scored}]",
      "expert_bias",
      tuple(np.shape(expert_bias)),
      f"[{scored}]",
    )


def _check_balance_counts(cfg: MoEConfig, balance_counts) -> None:
  """balance_counts: None, or [cfg.balance_counts_size] under balance_loss='global_batch'."""
  if balance_counts is not None:
    require(
      cfg.balance_loss == "global_batch",
      "balance_counts",
      "given",
      f"None unless balance_loss='global_batch' (it is {cfg.balance_loss!r})",
    )
    require(
      tuple(np.shape(balance_counts)) == (cfg.balance_counts_size,),
      "balance_counts",
      tuple(np.shape(balance_counts)),
      f"[{cfg.balance_counts_size}] (cfg.balance_counts_size)",
    )


def _check_token_ids(cfg: MoEConfig, x: jax.Array, token_ids) -> None:
  """token_ids: integers of x's shape without d where the router routes by them ('hash'), else None."""
  if not cfg.router.needs_token_ids:
    require(token_ids is None, "token_ids", "given", f"None unless routing='hash' (it is {cfg.routing!r})")
    return
  shape = None if token_ids is None else tuple(np.shape(token_ids))
  dtype = (
    None if token_ids is None else (token_ids.dtype if hasattr(token_ids, "dtype") else np.asarray(token_ids).dtype)
  )
  require(
    shape == tuple(x.shape[:-1]) and np.issubdtype(dtype, np.integer),
    "token_ids",
    shape,
    f"integer ids of shape {tuple(x.shape[:-1])} (x's without d) with routing={cfg.routing!r}",
  )


def _check_hash_index(cfg: MoEConfig, hash_index) -> None:
  """hash_index: None, or with routing='hash' a permutation of the E + Z experts' indices (a placement's)."""
  if hash_index is None:
    return
  require(cfg.router.needs_token_ids, "hash_index", "given", f"None unless routing='hash' (it is {cfg.routing!r})")
  scored = cfg.router.scored
  want = f"a permutation of 0 .. {scored - 1} (where each of the E + Z experts sits)"
  shape, dtype = tuple(np.shape(hash_index)), jnp.asarray(hash_index).dtype
  require(shape == (scored,) and jnp.issubdtype(dtype, jnp.integer), "hash_index", (shape, str(dtype)), want)
  if not isinstance(hash_index, jax.core.Tracer):  # the contents, where known before tracing
    index = np.asarray(hash_index)
    require(np.array_equal(np.sort(index), np.arange(scored)), "hash_index", index.tolist(), want)


def check_hash_table(cfg: MoEConfig, hash_table) -> None:
  """hash_table: None, or with routing='hash' and hash_vocab = V a table [V, K] int of each id's K distinct experts
  in [0, E + Z) (original numbering: a placement moves `hash_index`, never the table); its values checked where
  known (at construction, at load, in eager calls), each failure naming the row and its value."""
  if hash_table is None:
    return
  vocab, scored, k = cfg.hash_vocab, cfg.router.scored, cfg.top_k
  require(vocab > 0, "hash_table", "given", f"None unless hash_vocab > 0 with routing='hash' (hash_vocab={vocab})")
  shape, dtype = tuple(np.shape(hash_table)), jnp.asarray(hash_table).dtype
  want = f"[{vocab}, {k}] (hash_vocab, top_k) integer experts in [0, {scored}), distinct in each row"
  require(shape == (vocab, k) and jnp.issubdtype(dtype, jnp.integer), "hash_table", (shape, str(dtype)), want)
  if isinstance(hash_table, jax.core.Tracer):
    return
  table = np.asarray(hash_table)
  bad = np.argwhere((table < 0) | (table >= scored))
  if len(bad):
    row, col = bad[0]
    require(False, f"hash_table[{row}, {col}]", int(table[row, col]), f"an expert in [0, {scored}) (E + Z)")
  rows = np.sort(table, axis=1)
  repeated = np.flatnonzero((rows[:, 1:] == rows[:, :-1]).any(axis=1))
  if len(repeated):
    row = int(repeated[0])
    require(False, f"hash_table[{row}]", table[row].tolist(), f"{k} distinct experts (a token chooses each once)")


def _check_hash_ids(cfg: MoEConfig, token_ids) -> None:
  """With a table (hash_vocab = V), concrete token ids lie in [0, V) (traced ones are clipped and counted)."""
  if not cfg.hash_vocab or token_ids is None or isinstance(token_ids, jax.core.Tracer):
    return
  ids = np.asarray(token_ids).reshape(-1)
  bad = ids[(ids < 0) | (ids >= cfg.hash_vocab)]
  require(not len(bad), "token_ids", bad[:1].tolist(), f"ids in [0, hash_vocab={cfg.hash_vocab}) (the table's rows)")


def _check_chunks(cfg: MoEConfig, lay: Layout) -> None:
  """A schedule that splits the sent rows into num_chunks equal chunks needs num_chunks to divide them."""
  if cfg.schedule_kind.splits_rows and lay.rows % cfg.num_chunks:
    what = "token rows (dedup: one row per token)" if lay.dedup else "token-choice rows"
    raise ConfigError(
      f"num_chunks={cfg.num_chunks} does not divide the {lay.rows} {what} each device sends "
      f"(schedule={cfg.schedule!r} splits them into equal chunks)",
      "num_chunks",
      cfg.num_chunks,
      f"a divisor of {lay.rows}",
    )


def _check_platform(cfg: MoEConfig, sharding: ExpertParallel, mesh: jax.sharding.Mesh) -> None:
  """The collective runs on the mesh's platform, and no interpreted Pallas backend meets a sharding that needs
  shard_map's mesh-axis variance."""
  platform = platform_lib.of_mesh(mesh)
  collective_lib.check(cfg.collective, platform)
  require(
    not sharding.needs_vma or not cfg.backend_kind.interprets_on(platform),
    "expert_backend",
    cfg.expert_backend,
    f"not a Pallas backend with {sharding.name} on {platform}: its collectives are typed by shard_map's mesh-axis "
    "variance, which the Pallas interpreter cannot give (on GPU the compiled kernels can)",
  )


def check_inputs(
  params: dict,
  x: jax.Array,
  cfg: MoEConfig,
  mesh: jax.sharding.Mesh,
  slot_expert=None,
  expert_bias=None,
  balance_counts=None,
  token_ids=None,
  hash_index=None,
  hash_table=None,
) -> Layout:
  """Validates shapes and choices before tracing; returns the layout."""
  n, m = mesh_lib.axis_sizes(mesh)
  _require_concrete_backend(cfg)
  sharding = esp_lib.of(cfg)
  cfg.check_mesh(n, m)
  slots = None
  if slot_expert is not None:
    slots = replicas_lib.check_slot_table(slot_expert, cfg.num_experts, cfg.expert_holders(n, m), sharding.holder_unit)
  _check_params(params, cfg)
  tokens = _tokens_of(x, cfg)
  sharding.check_tokens(tokens, n, m)
  lay = layout(cfg, tokens, mesh, slots)
  _check_sequence_balance(cfg, x, lay)
  _check_expert_bias(cfg, expert_bias)
  _check_balance_counts(cfg, balance_counts)
  _check_token_ids(cfg, x, token_ids)
  _check_hash_index(cfg, hash_index)
  check_hash_table(cfg, hash_table)
  _check_hash_ids(cfg, token_ids)
  _check_chunks(cfg, lay)
  _check_platform(cfg, sharding, mesh)
  return lay
