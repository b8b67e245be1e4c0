"""Context-coherent decoding (ExFlow §IV-A): one exchange per MoE layer.

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

Top-k: ExFlow's experiments are top-1 only and its paper does not say where a token's k expert
outputs are combined for k > 1 (Table I counts 2 rows per token and layer for top-2). Here a token
has one expert per MoE layer: routings with more than one choice per token are rejected.

Memory: context coherence replicates every request's context, so a device holds the cache of the
whole batch (B x S per block, as ExFlow does by design); the resident-token buffer is B rows (worst
case: every token on one device; no token is ever dropped), and a block's attention gathers the
cache rows of the tokens resident there (at most B x S).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.moe import routing, schedule
from moejax.moe import transport as transport_lib
from moejax.moe.layer import ALL
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.train import model as model_lib
from moejax.validation import require


def check_moe(moe_cfg) -> None:
  """Rejects MoE layers that context-coherent decoding cannot run, naming the field."""
  require(moe_cfg.choices_per_token == 1, "top_k", moe_cfg.top_k,
          "1 with one choice per token for mode='exflow' (a token stays with its one expert; see moejax.infer.exflow)")
  require(moe_cfg.capacity_factor is None, "capacity_factor", moe_cfg.capacity_factor,
          "None (dropless) for mode='exflow': a token must reach its expert")
  require(moe_cfg.esp_schedule is None, "esp_schedule", moe_cfg.esp_schedule,
          "None for mode='exflow' (whole experts on one device each, where a token can stay)")


def sample(logits_RxV, requests_R, step, seed, temperature):
  """Next token of each row: argmax at temperature 0, else a draw from softmax(logits / temperature)
  with key fold_in(fold_in(key(seed), step), request): the same draw wherever the row is computed.
  step, seed, temperature: scalars (traced, so one compiled step serves every seed and temperature)."""
  base = jax.random.fold_in(jax.random.key(seed), step)
  keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(requests_R)
  scaled = logits_RxV / jnp.where(temperature > 0, temperature, 1.0)
  drawn = jax.vmap(jax.random.categorical)(keys, scaled)
  return jnp.where(temperature > 0, drawn, jnp.argmax(logits_RxV, axis=-1)).astype(jnp.int32)


def _expert_hop(block, x_RxD, requests_R, valid_R, buffer_rows: int, n: int, m: int, kind: str):
  """The one exchange of an MoE layer: rows go to their expert's device, get its output added to
  their residual there and stay. -> (x, requests, valid) of the rows now here, rows [D, D] sent."""
  moe = block.ffn.moe
  params, cfg = moe.params(), moe.cfg
  decision, _ = routing.route(block.ln_ffn(x_RxD), params, cfg)
  ids_R = jnp.where(valid_R, decision.expert_ids[:, 0], -1)
  experts_per_gpu = params["w_in"].shape[0]  # the local shard
  ids_R, route = transport_lib.plan_route(ids_R, transport_lib.FLAT_HOPS, {mesh_lib.NODE: n, mesh_lib.GPU: m},
                                          experts_per_gpu, max_rows=buffer_rows, kind=kind)
  # Residual, combine weight and request id travel as one fp32 row (ids < 2^24 are exact).
  packed = jnp.concatenate([x_RxD.astype(jnp.float32), decision.weights[:, :1],
                            requests_R[:, None].astype(jnp.float32)], axis=1)
  packed = transport_lib.move_through(packed, route, transport_lib.FLAT_HOPS, kind)
  x_RxD, weights_R, requests_R = packed[:, :-2].astype(x_RxD.dtype), packed[:, -2], packed[:, -1].astype(jnp.int32)
  exchange = schedule.Exchange(transport_lib.FLAT_HOPS, {mesh_lib.NODE: n, mesh_lib.GPU: m}, experts_per_gpu, kind,
                               None)
  local = schedule.Experts(params["w_in"], params["w_out"], params.get("w_gate"), cfg.activation,
                           cfg.expert_backend, jnp.dtype(cfg.dtype))
  y_RxD = schedule.run_experts(block.ln_ffn(x_RxD), ids_R, exchange, local)
  y_RxD = (weights_R[:, None] * y_RxD).astype(x_RxD.dtype)
  return x_RxD + y_RxD, requests_R, ids_R >= 0, route.plans[0].sizes_AxA


def _step_local(params, rest, cache, tokens_b, position, step, seed, temperature, *, graphdef, n, m, kind):
  """One device's decode step: its b requests' tokens [b] -> (next [b], logits [b, V], cache, counts)."""
  model = nnx.merge(graphdef, params, rest)
  b = tokens_b.shape[0]
  batch = b * n * m
  requests_R = mesh_lib.my_flat_index(m) * b + jnp.arange(b)
  x_RxD = model.embed_tokens(tokens_b[:, None], position)[:, 0]
  valid_R = jnp.ones((b,), bool)
  scatter = lambda rows, where_R, valid: jnp.zeros((batch,) + rows.shape[1:], rows.dtype).at[
      jnp.where(valid, where_R, batch)].set(rows, mode="drop")
  new_kv, sent = [], []
  for (k_cache, v_cache), block in zip(cache, model.blocks):
    mine = jnp.where(valid_R, requests_R, 0)
    x_Rx1xD, (k_RxSxHxW, v_RxSxHxW) = block.attend(x_RxD[:, None], train=False, rngs=None,
                                                   cache=(k_cache[mine], v_cache[mine], position))
    x_RxD = x_Rx1xD[:, 0]
    at = lambda kv: jax.lax.dynamic_index_in_dim(kv, position, axis=1, keepdims=False)
    new_kv.append(tuple(scatter(at(kv), requests_R, valid_R) for kv in (k_RxSxHxW, v_RxSxHxW)))
    if isinstance(block.ffn, model_lib.MoEFFN):
      x_RxD, requests_R, valid_R, rows = _expert_hop(block, x_RxD, requests_R, valid_R, batch, n, m, kind)
      sent.append(rows)
    else:
      x_RxD, _ = block.feed_forward(x_RxD, train=False, rngs=None)
  logits_RxV = model.head_logits(x_RxD)
  next_R = sample(logits_RxV, requests_R, step, seed, temperature)
  # The step's all-gather: every row was written by exactly one device, so the sums are exact.
  next_B, logits_BxV, new_kv = jax.lax.psum(
      (scatter(next_R, requests_R, valid_R), scatter(logits_RxV, requests_R, valid_R), new_kv), ALL)
  write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new[:, None], position, axis=1)
  cache = [(write(k, nk), write(v, nv)) for (k, v), (nk, nv) in zip(cache, new_kv)]
  own = lambda a: jax.lax.dynamic_slice_in_dim(a, mesh_lib.my_flat_index(m) * b, b)
  rows = jnp.stack(sent) if sent else jnp.zeros((0, n * m, n * m), jnp.int32)
  return own(next_B), own(logits_BxV), cache, {"rows": rows, "dropped": jnp.zeros((), jnp.int32)}


def exflow_step(model: model_lib.LanguageModel):
  """The jitted step (params, rest, cache, tokens [B], position, step, seed, temperature) -> (next
  [B], logits [B, V], cache, counts). counts: 'rows' [M, D, D] sent from flat device s to p in each
  MoE layer's exchange, 'dropped' 0 (dropless). params, rest: the model's state as pure dicts; cache
  replicated (`init_cache(..., coherent=True)`); tokens sharded over both mesh axes, request r owned
  by flat device r // (B / D)."""
  check_moe(model.moe_cfg)
  return _compiled_step(model.cfg, model.moe_cfg, model.mesh)


@functools.lru_cache(maxsize=16)
def _compiled_step(cfg: model_lib.ModelConfig, moe_cfg, mesh: jax.sharding.Mesh):
  n, m = mesh_lib.axis_sizes(mesh)
  graphdef, params, rest = model_lib.abstract_state(cfg, moe_cfg, mesh)
  spec = lambda tree: jax.tree.map(lambda a: a.sharding.spec, tree)
  kind = platform_lib.exchange_kind(moe_cfg.transport, platform_lib.of_mesh(mesh))
  body = functools.partial(_step_local, graphdef=graphdef, n=n, m=m, kind=kind)
  cache_specs = [(P(), P())] * cfg.num_layers
  step = jax.shard_map(body, mesh=mesh, in_specs=(spec(params), spec(rest), cache_specs, P(ALL), P(), P(), P(), P()),
                       out_specs=(P(ALL), P(ALL), cache_specs, {"rows": P(), "dropped": P()}), check_vma=False)
  return jax.jit(step)
