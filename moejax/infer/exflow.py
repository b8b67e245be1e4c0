"""Context-coherent decoding (ExFlow §IV-A): one exchange per MoE layer (k for top-k).

Every device holds the KV cache of every request (gathered once after the prefill). Each device still
owns its B / D requests: their new tokens start there and run the first attention. At an MoE layer a
token is routed where it is and sent to the device holding its expert (the one exchange); the expert
adds its output to the token's residual there, and the token stays: the next attention runs in
place against the replicated cache, the next MoE layer routes it from there. After the last block
the token is sampled where it ended, and the step's new state (token ids, and the keys and values
each block computed on whatever device the token was) is gathered onto every device, by an
all-reduce of zero-filled scatter buffers (each row written by exactly one device, so the sums are
exact): ExFlow's all-gather of the new tokens, which with a KV cache must carry the per-block keys
and values (the paper counts tokens only, Table I's G N G term). The logits travel with it so that
each owner returns its requests' logits.

Top-k: ExFlow's experiments are top-1 and the paper does not say where a token's k expert outputs
are combined (Table I counts 2 rows per token and layer for top-2). Here the token is routed once,
where it is, then visits its k experts' devices in choice order (one move per choice), carrying its
residual, the weighted outputs so far and its k expert ids; it stays at the last expert's device
with residual + the weighted sum. k moves per token and layer (Table I's count), in k exchanges.

Honoured: `path` (its hops: flat, or the two-hop paths), `collective` ('ragged', 'padded', 'auto') and
`buffer_factor` (each hop receives at most ceil(factor x B / D)
rows, so the resident-token buffer and a block's cache gather follow the bound, not the batch;
rows that do not fit are counted in the step's 'dropped' / 'overflowed', and `decode.generate`
repeats such a step with the factor doubled: a lost token would corrupt its request).
Refused before compiling (`check_moe`, ConfigError naming the field):
- collective='capacity' and capacity_factor: the token moves to its expert and stays (no combine
  brings it home), so a capacity drop would lose the token itself, and which tokens drop would
  depend on what the previous layers left resident on a device, not on the request.
- schedule='chunked' | 'comet': the exchange is one-way (no combine); comet overlaps the combine
  with the second GEMM, and chunking would only split the B / D rows of a step into smaller
  exchanges, each with its own resident buffer.
- esp_schedule (experts split over GPUs: no one device where the token can stay).
Slot tables (slots_per_device, Lina's replicas) are honoured: a token goes to one replica of each of its
experts (the layer's rule, `moe.replicas.to_slots`) and stays at the last one.

Memory: context coherence replicates every request's context, so a device holds the cache of the
whole batch (B x S per block, as ExFlow does by design); the resident-token buffer is B rows (worst
case: every token on one device) or the buffer_factor bound, and a block's attention gathers the
cache rows of the tokens resident there. Scanned layers (`moejax.models.layers`) run the step's layers as loops whose
carry keeps one shape, so every layer, those before the first MoE layer too, runs on that buffer's rows.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.infer import cache as cache_lib
from moejax.infer.exflow_hop import expert_hop
from moejax.models import backbone, sparse_attention
from moejax.models import layers as layers_lib
from moejax.models.blocks import MoEFFN
from moejax.models.config import ModelConfig, moe_block_indices
from moejax.models.language_model import LanguageModel
from moejax.models.state import abstract_state
from moejax.moe import collective as collective_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe import schedule
from moejax.moe.layer import exchange_for
from moejax.moe.layout import Layout, layout
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES
from moejax.validation import require


def check_moe(moe_cfg, platform: str | None = None) -> None:
  """Rejects MoE layers that context-coherent decoding cannot run, naming the field and the reason
  (before compiling). platform: the mesh's ('cpu', 'gpu', ...), to check the collective runs there."""
  require(
    not collective_lib.as_collective(moe_cfg.collective).fixed_blocks,
    "collective",
    moe_cfg.collective,
    "not 'capacity' for mode='exflow': a token moves to its expert and stays there (no combine brings it "
    "home), so a capacity drop would lose the token itself, and which tokens drop would depend on the tokens "
    "resident on a device after the previous layers, not on the request; use a ragged collective, with "
    "buffer_factor to bound the buffers (overflowing steps are repeated, never dropped)",
  )
  require(
    moe_cfg.capacity_factor is None,
    "capacity_factor",
    moe_cfg.capacity_factor,
    "None (dropless) for mode='exflow': a token must reach its expert",
  )
  require(
    not moe_cfg.schedule_kind.overlaps,
    "schedule",
    moe_cfg.schedule,
    "'sequential' for mode='exflow': its one exchange per MoE layer is one-way (no combine), so 'comet' has "
    "no combine to overlap with the second GEMM, and 'chunked' would only split the B / D rows of a decode "
    "step into smaller exchanges, each with its own resident-token buffer",
  )
  for name in ("dispatch_dtype", "combine_dtype"):
    require(
      getattr(moe_cfg, name) is None,
      name,
      getattr(moe_cfg, name),
      "None for mode='exflow': its rows are a "
      "token's residual stream and partial sums, which stay with the token across the layers, so a lossy wire "
      "would compound over them (the training layer's rows are an expert's input, quantised once)",
    )
  require(
    not moe_cfg.sharding_kind.splits_d_ff,
    "esp_schedule",
    moe_cfg.esp_schedule,
    "None for mode='exflow' (whole experts on one device each, where a token can stay)",
  )
  if platform is not None:
    collective_lib.check(moe_cfg.collective, platform)


def sample(logits_RxV, requests_R, step, seed, temperature):
  """Next token of each row: argmax at temperature 0, else a draw from softmax(logits / temperature)
  with key fold_in(fold_in(key(seed), step), request): the same draw wherever the row is computed.
  step, seed, temperature: scalars (traced, so one compiled step serves every seed and temperature)."""
  base = jax.random.fold_in(jax.random.key(seed), step)
  keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(requests_R)
  scaled = logits_RxV / jnp.where(temperature > 0, temperature, 1.0)
  drawn = jax.vmap(jax.random.categorical)(keys, scaled)
  return jnp.where(temperature > 0, drawn, jnp.argmax(logits_RxV, axis=-1)).astype(jnp.int32)


def _scatter(rows, where_R, valid_R, batch: int):
  """rows [R, ...] at their requests' places `where_R` [R] of a zero buffer [batch, ...]; invalid rows dropped."""
  buffer = jnp.zeros((batch,) + rows.shape[1:], rows.dtype)
  return buffer.at[jnp.where(valid_R, where_R, batch)].set(rows, mode="drop")


def _step_exchange(lay: Layout, b: int, buffer_factor) -> schedule.Exchange:
  """The layer's exchange for a step of b tokens per device. Each hop moves a device's resident tokens, one row
  each: at most ceil(buffer_factor * b) with a bound; without one, the batch (every token is resident on one
  device, so a hop never receives more; the worst case over the senders, A times the rows, would compound over a
  layer's k moves and the layers)."""
  bound = collective_lib.buffer_bound(buffer_factor, b)
  return exchange_for(lay)._replace(buffer_rows=b * lay.n * lay.m if bound is None else bound)


def _fit(resident: int, x_RxD, requests_R, valid_R):
  """The resident rows padded with invalid rows to `resident` (a scan's carry keeps its shape); none padded when
  there are as many or more. x: [R, d], or a `sparse_attention.Stream` of rows (x [R, d], choice [R, K])."""
  pad = lambda a, fill: (
    jnp.concatenate([a, jnp.full((resident - a.shape[0], *a.shape[1:]), fill, a.dtype)]) if a.shape[0] < resident else a
  )
  return jax.tree.map(lambda a: pad(a, 0), x_RxD), pad(requests_R, 0), pad(valid_R, False)


def _coherent_layer(
  block, carry, kv_cache, rngs, *, position, batch: int, resident: int, lay: Layout, exchange, tokens_B=None
):
  """One layer (`backbone.fold_layers`: unrolled, or in its segment's scan): attention against the replicated
  cache rows of the resident tokens (`block.attend`), then the dense FFN in place, or the MoE layer's hop and the
  block's rest where each row then is (`block.after_experts`) -> (carry, (this position's new keys and values
  scattered to the batch's rows, the hop's rows [A, A] or None)). tokens_B: every request's token ('hash')."""
  x_RxD, requests_R, valid_R, lost = carry
  mine = jnp.where(valid_R, requests_R, 0)
  rows_of = lambda requests: tuple(c[requests] for c in kv_cache)  # the cache's rows of these requests
  x_Rx1xD, layer_cache = block.attend(
    jax.tree.map(lambda a: a[:, None], x_RxD),  # x, or a Stream ('dsa_shared' layers: the rows' choices beside)
    train=False,
    rngs=None,
    cache=(*rows_of(mine), position),
  )
  x_RxD = jax.tree.map(lambda a: a[:, 0], x_Rx1xD)
  # a cache without a sequence axis (a gated DeltaNet layer's state) is new whole, else only at this position
  sequence = getattr(block.attn, "cache_has_positions", True)
  at = lambda kv: jax.lax.dynamic_index_in_dim(kv, position, axis=1, keepdims=False) if sequence else kv
  new_kv = tuple(_scatter(at(kv), requests_R, valid_R, batch) for kv in layer_cache)
  if not isinstance(block.ffn, MoEFFN):
    return (block.feed_forward(x_RxD, train=False, rngs=None)[0], requests_R, valid_R, lost), (new_kv, None)
  ids_R = None if tokens_B is None else tokens_B[mine]  # routing='hash': each row's token, looked up by its request
  x_RxD, y_RxD, requests_R, valid_R, rows, overflowed = expert_hop(
    block, x_RxD, requests_R, valid_R, lay, exchange, ids_R
  )
  # The block's rest where the row now is (LongCat's ScMoE layer: its second attention, against the cache's rows of
  # the requests now here, whose new keys and values join the first's).
  moved = jnp.where(valid_R, requests_R, 0)
  rows_1 = lambda tree: jax.tree.map(lambda a: a[:, None], tree)  # [R, ...] -> [R, 1, ...]: one position a row
  x_Rx1xD, pair = block.after_experts(rows_1(x_RxD), y_RxD[:, None], cache=(*rows_of(moved), position))
  x_RxD = jax.tree.map(lambda a: a[:, 0], x_Rx1xD)
  if pair is not None:
    later = (_scatter(at(kv), requests_R, valid_R, batch) for kv in pair)
    new_kv = tuple(jnp.stack([first, second], axis=1) for first, second in zip(new_kv, later))
  return (*_fit(resident, x_RxD, requests_R, valid_R), lost + overflowed), (new_kv, rows)


def _write_cache(cache, new_kv, position, scan_layers: bool):
  """The cache with every layer's new keys and values [B, ...] written at `position`; an entry without a sequence
  axis (as many axes as the cache's: a gated DeltaNet layer's state) replaced whole."""
  axis = 2 if scan_layers else 1  # the cache's positions: [B, S, ...], or stacked [repeats, B, S, ...]

  def write(c, new):
    if new.ndim == c.ndim:
      return new.astype(c.dtype)
    return jax.lax.dynamic_update_slice_in_dim(c, jnp.expand_dims(new, axis), position, axis=axis)

  return jax.tree.map(write, cache, new_kv)


def _exchanged_rows(outputs, cfg: ModelConfig, devices: int) -> jax.Array:
  """[M, A, A] rows each MoE layer moved between flat devices (M = 0: [0, A, A])."""
  rows = layers_lib.stack_selected(layers_lib.map_outputs(lambda o: o[1], outputs, cfg), cfg, cfg.is_moe)
  return jnp.zeros((0, devices, devices), jnp.int32) if rows is None else rows


def _step_local(
  params, rest, cache, tokens_b, position, step, seed, temperature, *, graphdef, lay: Layout, buffer_factor
):
  """One device's decode step: its b requests' tokens [b] -> (next [b], logits [b, V], cache, counts)."""
  model = nnx.merge(graphdef, params, rest)
  b, n, m = tokens_b.shape[0], lay.n, lay.m
  batch = b * n * m
  requests_R = mesh_lib.my_flat_index(m) * b + jnp.arange(b)
  x_Bx1xD = model.embed_tokens(tokens_b[:, None], position)
  # x [b, d], or a Stream ('dsa_shared' layers: each row's choice of the cache's keys beside it, moved with it)
  x_RxD = jax.tree.map(lambda a: a[:, 0], sparse_attention.begin(model.cfg, x_Bx1xD, cache))
  valid_R = jnp.ones((b,), bool)
  exchange = _step_exchange(lay, b, buffer_factor)
  # A scan's carry keeps its shape: the resident rows are padded (invalid rows) to the most a hop delivers or the b
  # own rows, whichever is more, before the first layer and after each hop. Unrolled, each layer takes the rows
  # there are (the layers before the first MoE layer only the device's own b).
  resident = max(b, exchange.buffer_rows) if model.cfg.scan_layers else 0
  # routing='hash': every request's token [B] on every device (rows move to other devices; B int32, once a step)
  ids = backbone.routing_ids(model.cfg, model.moe_cfg, tokens_b)
  tokens_B = None if ids is None else jax.lax.psum(_scatter(ids, requests_R, valid_R, batch), AXES)
  layer = functools.partial(
    _coherent_layer, position=position, batch=batch, resident=resident, lay=lay, exchange=exchange, tokens_B=tokens_B
  )
  (x_RxD, requests_R, valid_R, lost), outputs = backbone.fold_layers(
    model, layer, (*_fit(resident, x_RxD, requests_R, valid_R), jnp.zeros((), jnp.int32)), cache
  )
  logits_RxV = model.head_logits(sparse_attention.activations(x_RxD))
  next_R = sample(logits_RxV, requests_R, step, seed, temperature)
  # The step's all-gather: every row was written by exactly one device, so the sums are exact.
  next_B, logits_BxV, new_kv = jax.lax.psum(
    (
      _scatter(next_R, requests_R, valid_R, batch),
      _scatter(logits_RxV, requests_R, valid_R, batch),
      layers_lib.map_outputs(lambda o: o[0], outputs, model.cfg),
    ),
    AXES,
  )
  cache = _write_cache(cache, new_kv, position, model.cfg.scan_layers)
  own = lambda a: jax.lax.dynamic_slice_in_dim(a, mesh_lib.my_flat_index(m) * b, b)
  rows = _exchanged_rows(outputs, model.cfg, n * m)
  return own(next_B), own(logits_BxV), cache, {"rows": rows, "dropped": lost, "overflowed": lost}


def exflow_step(model: LanguageModel, moe_cfg=None):
  """The jitted step (params, rest, cache, tokens [B], position, step, seed, temperature) -> (next
  [B], logits [B, V], cache, counts). counts: 'rows' [M, A, A] moved from flat device s to p in each
  MoE layer's exchanges (summed over the hops and choices), 'dropped' = 'overflowed' the token rows
  lost to full receive buffers (buffer_factor; the step's outputs are then wrong: `decode.generate` repeats it with
  a doubled buffer_factor). moe_cfg: the model's (default) or the same with another buffer_factor.
  params, rest: the model's state as pure dicts; cache replicated (`init_cache(..., coherent=True)`);
  tokens sharded over both mesh axes, request r owned by flat device r // (B / D)."""
  moe_cfg = model.moe_cfg if moe_cfg is None else moe_cfg
  check_moe(moe_cfg, platform_lib.of_mesh(model.mesh))
  return _compiled_step(model.cfg, moe_cfg, model.mesh)


@functools.lru_cache(maxsize=16)
def _compiled_step(cfg: ModelConfig, moe_cfg, mesh: jax.sharding.Mesh):
  graphdef, params, rest = abstract_state(cfg, moe_cfg, mesh)
  spec = lambda tree: jax.tree.map(lambda a: a.sharding.spec, tree)
  lay = layout(moe_cfg, mesh.size, mesh, moe_cfg.slots_per_device)  # hops, collective, slots (bound: per step)
  body = functools.partial(_step_local, graphdef=graphdef, lay=lay, buffer_factor=moe_cfg.buffer_factor)
  cache_specs = cache_lib.layout(cfg, lambda repeats, layer: (P(),) * len(cache_lib.layer_specs(cfg, layer, 1, 1)))
  step = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(spec(params), spec(rest), cache_specs, P(AXES), P(), P(), P(), P()),
    out_specs=(P(AXES), P(AXES), cache_specs, {"rows": P(), "dropped": P(), "overflowed": P()}),
    check_vma=False,
  )
  if moe_cfg.slots_per_device is None:
    return jax.jit(step)

  def on_slots(params, rest, *args):
    """The experts' weights laid out per physical slot of each layer's table (sharded as the logical
    ones, one block of slots per device), so a device runs the replicas its slots hold (a scanned segment's
    repeats each on its own table)."""
    params = jax.tree.map(lambda a: a, params)  # a copy of the dicts, written below
    done = set()
    for path, r in (layers_lib.where(cfg)[i] for i in moe_block_indices(cfg)):
      if path in done:
        continue
      done.add(path)
      moe = layers_lib.subtree(params, path, None)["ffn"]["moe"]
      table = layers_lib.subtree(rest, path, None)["ffn"]["moe"]["slot_expert"]
      physical = replicas_lib.physical_params if r is None else jax.vmap(replicas_lib.physical_params)
      moe.update(physical({k: moe[k] for k in replicas_lib.EXPERT_WEIGHTS if k in moe}, table))
    return step(params, rest, *args)

  return jax.jit(on_slots)
