"""An MoE layer's exchange under context-coherent decoding (`moejax.infer.exflow`): each token visits its k
experts' devices in choice order and stays at the last one."""

import jax
import jax.numpy as jnp

from moejax.models import sparse_attention
from moejax.moe import local_experts, routing, schedule
from moejax.moe import path as path_lib
from moejax.moe import replicas as replicas_lib
from moejax.moe.experts import shared_experts
from moejax.moe.layout import Layout
from moejax.moe.routing import zero
from moejax.moe.traffic import hop_traffic
from moejax.runtime import mesh as mesh_lib
from moejax.runtime.mesh import AXES

STAY = -2  # a choice's id in a row for a zero-computation expert's: the row stays where it is (-1: no row)


def expert_hop(block, x_RxD, requests_R, valid_R, lay: Layout, exchange: schedule.Exchange, token_ids_R=None):
  """An MoE layer's exchange: each row visits the devices of its k experts in turn (one move per
  choice, along the path's hops) and gets each expert's weighted output there; it stays at its
  last expert's device with its residual plus the weighted sum. The training layer's stages (routing,
  replicas, shared experts, the plan, the exchange, the experts), one choice at a time.
  -> (x, y, requests, valid) of the rows now here (y [R, e] float32: the experts' weighted output, which the block
  adds: `after_experts`; e the experts' width, x's d = N e for mHC's N streams), rows [A, A] moved between flat devices, rows lost to full receive buffers (every
  device's). token_ids_R: the rows' token ids, which routing='hash' routes by. x may be a
  `sparse_attention.Stream` (GLM-5's shared DSA layers): each row's choice of keys [K] travels in the row beside it."""
  stream, x_RxD = x_RxD, sparse_attention.activations(x_RxD)
  moe = block.ffn.moe
  params, cfg = moe.params(), moe.cfg
  # d: the row's residual width, e: the experts' (mHC layers carry their N streams: d = N e)
  d, e, k = x_RxD.shape[1], cfg.d_model, cfg.choices_per_token
  ids_RxK, weights_RxK, shared_RxE = _choices(block, x_RxD, lay, exchange, token_ids_R)
  here = mesh_lib.my_flat_index(lay.m) * exchange.slots_per_device  # a slot on this device: where a row stays
  local = local_experts.Experts.of(params, cfg)
  # One fp32 row per token: residual, weighted outputs so far, the k weights and expert ids, a Stream's choice of
  # keys, the request id (ids and key positions < 2^24 are exact).
  f32 = lambda a: a.astype(jnp.float32)
  choice_RxP = f32(stream.topk) if isinstance(stream, sparse_attention.Stream) else jnp.zeros((x_RxD.shape[0], 0))
  packed = jnp.concatenate(
    [f32(x_RxD), shared_RxE, f32(weights_RxK), f32(ids_RxK), choice_RxP, f32(requests_R)[:, None]], axis=1
  )
  ids_at = lambda rows, j, valid: jnp.where(valid, rows[:, d + e + k + j].astype(jnp.int32), -1)
  traffic, lost = jnp.zeros((lay.n * lay.m,) * 2, jnp.int32), jnp.zeros((), jnp.int32)
  for j in range(k):
    sent_R = ids_at(packed, j, valid_R)
    sent_R = jnp.where(sent_R == STAY, here, sent_R)  # a zero expert's choice: to this device, weighted 0
    ids_Rx1, path = schedule.plan(sent_R[:, None], exchange)
    packed, valid_R = path_lib.move_through(packed, path), ids_Rx1[:, 0] >= 0
    lost += jnp.sum(sent_R >= 0, dtype=jnp.int32) - jnp.sum(valid_R, dtype=jnp.int32)
    traffic += sum(hop_traffic((path,), lay))
    x_RxD = packed[:, :d].astype(x_RxD.dtype)
    w_Rx1 = jnp.where(valid_R, packed[:, d + e + j], 0.0)[:, None]  # the experts weight (weight_inputs: their input)
    y_RxE = schedule.run_experts(block.ffn_input(x_RxD), ids_Rx1, w_Rx1, exchange, local, path.bound)
    packed = packed.at[:, d : d + e].add(y_RxE)
  if isinstance(stream, sparse_attention.Stream):
    x_RxD = sparse_attention.Stream(x_RxD, packed[:, d + e + 2 * k : -1].astype(jnp.int32))
  y_RxE = packed[:, d : d + e]
  return x_RxD, y_RxE, packed[:, -1].astype(jnp.int32), valid_R, traffic, jax.lax.psum(lost, AXES)


def _choices(block, x_RxD, lay: Layout, exchange: schedule.Exchange, token_ids_R):
  """The rows' routing -> (ids_RxK: each choice's slot, STAY for a zero-computation expert's; weights_RxK, 0 there;
  shared_RxE float32: the shared experts' output and the zero experts' (the token times their weights), computed where
  the token is before it moves, which start the sum)."""
  moe = block.ffn.moe
  params, cfg = moe.params(), moe.cfg
  value = lambda variable: None if variable is None else variable[...]
  decision, _ = routing.route(  # (loss stats unused)
    block.ffn_input(x_RxD), params, cfg, value(moe.expert_bias), sequence_length=1, token_ids_T=token_ids_R,
    hash_index_S=value(moe.hash_index), hash_table_VxK=value(moe.hash_table),  # the table replicated: looked up here
  )  # fmt: skip
  # A zero-computation expert's choice (id >= E) is the token itself, added where the token is: at that choice the
  # row stays on its device (`STAY`), weighted 0 there.
  zero_RxK = ~zero.real(decision.expert_ids, cfg.num_experts)
  ids_RxK = jnp.where(zero_RxK, 0, decision.expert_ids)
  if moe.slot_expert is not None:  # to one replica of each choice's expert; the token stays there
    ids_RxK = replicas_lib.to_slots(
      ids_RxK.reshape(-1), moe.slot_expert[...].reshape(-1), cfg.num_experts, lay.sharding.holder_index(lay.m)
    ).reshape(ids_RxK.shape)
  ids_RxK = jnp.where(zero_RxK, STAY, ids_RxK)
  weights_RxK = jnp.where(zero_RxK, jnp.zeros((), decision.weights.dtype), decision.weights)
  if lay.dedup:  # a token's choices on one device made consecutive, so it moves to each device once; stays last
    key_RxK = jnp.where(zero_RxK, lay.n * lay.m, ids_RxK // exchange.slots_per_device)
    order_RxK = jnp.argsort(key_RxK, axis=1, stable=True)
    ids_RxK, weights_RxK = (jnp.take_along_axis(a, order_RxK, axis=1) for a in (ids_RxK, weights_RxK))
  shared_RxE = (
    shared_experts(block.ffn_input(x_RxD), params, cfg)
    if cfg.num_shared_experts
    else jnp.zeros((x_RxD.shape[0], cfg.d_model), jnp.float32)
  )
  if cfg.zero_experts:
    shared_RxE += zero.identity_sum(block.ffn_input(x_RxD), decision.expert_ids, decision.weights, cfg.num_experts)
  return ids_RxK, weights_RxK, shared_RxE
