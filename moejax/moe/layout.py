"""How one layer call spreads over the mesh (`Layout`), and the checks of a call's inputs before tracing."""

from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.moe import replicas as replicas_lib
from moejax.moe import routing
from moejax.moe import transport as transport_lib
from moejax.moe.config import MoEConfig
from moejax.moe.params import param_shapes
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES, NODE
from moejax.validation import ConfigError, require


class Layout(NamedTuple):
  """How one layer call spreads over the mesh, fixed before tracing (`layout`).

  holders: where expert slots live: D devices, or n nodes with expert sharding (each slot's d_ff split
    over the node's GPUs); slots: Z, expert slots per holder (E / holders, or a slot table's width);
  tokens: the tokens one device routes (one dispatch group: capacity counts within it);
  rows: the token-choice rows one device sends after expert sharding's split or copies, before the Dump;
  copies: rows per token-choice after the Dump (m for s1 / s2, else 1); gathered: the baseline's m copies
    of the node's tokens (else 1); hops: the exchange hops; kind: the exchange kind;
  x_spec: the sharding of x and y; routed_over / sent_over: the mesh axes along which devices route
    different tokens / send different rows (what sums of statistics and counts run over).
  """

  n: int
  m: int
  holders: int
  slots: int
  tokens: int
  rows: int
  copies: int
  gathered: int
  hops: tuple
  kind: transport_lib.Kind
  x_spec: P
  routed_over: tuple
  sent_over: tuple


def layout(cfg: MoEConfig, tokens: int, mesh: jax.sharding.Mesh, slots: int | None = None) -> Layout:
  """The layer's layout for `tokens` global tokens on `mesh`; slots: a slot table's width (None: none).
  Raises ConfigError naming the field where the pieces cannot meet."""
  n, m = mesh_lib.axis_sizes(mesh)
  esp, k = cfg.esp_schedule, cfg.choices_per_token
  require(esp != "auto", "esp_schedule", esp, "a concrete schedule: resolve 'auto' when the config is made "
          "(moejax.moe.expert_sharding.resolve_auto(cfg, tokens, nodes, gpus_per_node); the trainer does)")
  holders = n if esp is not None else n * m
  per_holder = cfg.check_mesh(n, m)
  slots = per_holder if slots is None else slots
  if esp is None:
    local = tokens // (n * m)
    routed, sent, x_spec, route_tokens, rows, copies, gathered = AXES, AXES, P(AXES), local, local * k, 1, 1
  else:
    local = tokens // n
    x_spec, gathered, copies = P(NODE), (m if esp == "baseline" else 1), (1 if esp == "baseline" else m)
    route_tokens = local // m if esp == "s1" else local
    routed = AXES if esp == "s1" else (NODE,)
    sent = (NODE,) if esp == "baseline" else AXES
    rows = {"baseline": m * local * k, "s1": route_tokens * k, "s2": -(-local * k // m)}[esp]
    if esp == "s2" and cfg.capacity_factor is not None:  # the slot buffer [E, C'] split on its capacity axis
      rows = cfg.num_experts * s2_capacity(cfg, route_tokens, m) // m
  hops = transport_lib.transport_hops(cfg.transport)
  if esp == "baseline":
    require(hops == transport_lib.FLAT_HOPS, "transport", cfg.transport,
            "a one-hop transport with esp_schedule='baseline': its exchange runs over 'node' alone (each GPU to "
            "the same GPU index of the expert's node, whose ESP all-reduce needs every GPU of a node to hold the "
            "same rows), so there is no intra-node hop for a two-hop transport to take")
    hops = (NODE,)
  kind = platform_lib.exchange_kind(cfg.transport, platform_lib.of_mesh(mesh))
  if kind == transport_lib.DENSE:  # a block per peer: every slot of the peer full, for each copy
    per_slot = routing.expert_capacity(cfg, route_tokens) * gathered
    if esp == "s2":
      per_slot = s2_capacity(cfg, route_tokens, m) // m
    kind = transport_lib.Kind(kind, slots * per_slot)
  return Layout(n, m, holders, slots, route_tokens, rows, copies, gathered, hops, transport_lib.as_kind(kind),
                x_spec, routed, sent)


def s2_capacity(cfg: MoEConfig, tokens: int, gpus_per_node: int) -> int:
  """S2's capacity C padded to a multiple of m, so that the slot buffer [E, C'] splits evenly over the
  node's GPUs (padding slots stay empty)."""
  capacity = routing.expert_capacity(cfg, tokens)
  return -(-capacity // gpus_per_node) * gpus_per_node


def check_inputs(params: dict, x: jax.Array, cfg: MoEConfig, mesh: jax.sharding.Mesh, slot_expert=None,
                 expert_bias=None, balance_counts=None) -> Layout:
  """Validates shapes and choices before tracing; returns the layout."""
  n, m = mesh_lib.axis_sizes(mesh)
  cfg.check_mesh(n, m)
  slots = None
  if slot_expert is not None:
    holders = n if cfg.esp_schedule is not None else n * m
    slots = replicas_lib.check_slot_table(slot_expert, cfg.num_experts, holders,
                                          "nodes" if cfg.esp_schedule is not None else "devices")
  if not isinstance(params, dict):
    raise ConfigError(f"params must be a dict in the documented layout, got {type(params).__name__}")
  want = param_shapes(cfg)
  got = jax.tree.map(lambda a: tuple(a.shape), params)
  if got != want:
    raise ConfigError(f"parameter shapes {got} do not match the layout for this config: {want}")
  if x.ndim not in (2, 3) or x.shape[-1] != cfg.d_model:
    raise ConfigError(f"x has shape {x.shape}; expected [tokens, {cfg.d_model}] or [batch, seq, {cfg.d_model}]")
  tokens = x.size // cfg.d_model
  if cfg.esp_schedule is None and tokens % (n * m):
    raise ConfigError(f"x has {tokens} tokens, not a multiple of the mesh's {n * m} devices")
  groups = n * m if cfg.esp_schedule == "s1" else n
  if cfg.esp_schedule is not None and tokens % groups:
    where = "each node's tokens split over its GPUs" if cfg.esp_schedule == "s1" else "tokens sharded over the nodes"
    raise ConfigError(f"x has {tokens} tokens, not a multiple of {groups} (esp_schedule={cfg.esp_schedule!r}: "
                      f"{where})")
  lay = layout(cfg, tokens, mesh, slots)
  if cfg.balance_loss == "sequence":
    require(x.ndim == 3 and lay.tokens % x.shape[1] == 0, "balance_loss", cfg.balance_loss,
            f"'batch' unless x is [batch, seq, d] with whole sequences on each routing device (x {x.shape}, "
            f"{lay.tokens} tokens routed per device)")
  if expert_bias is not None and tuple(np.shape(expert_bias)) != (cfg.num_experts,):
    raise ConfigError(f"expert_bias has shape {tuple(np.shape(expert_bias))}; expected [{cfg.num_experts}]",
                      "expert_bias", tuple(np.shape(expert_bias)), f"[{cfg.num_experts}]")
  if balance_counts is not None:
    require(cfg.balance_loss == "global_batch", "balance_counts", "given",
            f"None unless balance_loss='global_batch' (it is {cfg.balance_loss!r})")
    require(tuple(np.shape(balance_counts)) == (cfg.balance_counts_size,), "balance_counts",
            tuple(np.shape(balance_counts)), f"[{cfg.balance_counts_size}] (cfg.balance_counts_size)")
  if cfg.schedule == "chunked" and lay.rows % cfg.num_chunks:
    raise ConfigError(f"num_chunks={cfg.num_chunks} does not divide the {lay.rows} token-choice rows each device "
                      f"sends (schedule='chunked' splits them into equal chunks)", "num_chunks", cfg.num_chunks,
                      f"a divisor of {lay.rows}")
  platform = platform_lib.of_mesh(mesh)
  platform_lib.check_transport(cfg.transport, platform)
  require(cfg.esp_schedule is None or platform_lib.check_vma(cfg.expert_backend, platform),
          "expert_backend", cfg.expert_backend,
          f"not 'pallas' with esp_schedule on {platform}: expert sharding's collectives are typed by shard_map's "
          "mesh-axis variance, which the Pallas interpreter cannot give (on GPU the compiled kernels can)")
  return lay
