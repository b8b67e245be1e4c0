"""Per-phase wall-clock of one MoE layer forward, from separately jitted phases.

The layer runs once to get its real routing (aux traffic_rows per hop and expert_counts); then each
phase is timed as a program of its own at exactly those sizes, with the layer's buffer shapes:
every hop's dispatch exchange (rows and their expert ids, as `path.plan_path` and `move_through` send them) and
combine exchange (rows) over its mesh axes, by the layer's collective (with 'capacity', its fixed blocks per peer),
and the expert FFN on each device's received rows.

An exchange over 'gpu' counts as intra-node; over 'node', or over both axes on more than one node,
as inter-node (the classification of `moejax.cost`). 'other' is the whole layer's time minus the
timed phases: routing, sorting, permutations, the weighted combine, and whatever the fused program
saves or adds; it can come out slightly negative.
"""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.moe import collective as collective_lib
from moejax.moe import experts
from moejax.moe import path as path_lib
from moejax.moe import plan as plan_lib
from moejax.moe.config import MoEConfig
from moejax.moe.layer import exchange_for, moe_apply
from moejax.moe.layout import layout
from moejax.runtime import mesh as mesh_lib
from moejax.runtime import platform as platform_lib
from moejax.runtime.mesh import AXES
from moejax.study.repeats import Repeats, timed


def hop_sizes(traffic_AxA: np.ndarray, axis, n: int, m: int) -> np.ndarray:
  """[D, A, A]: for each device, the rows between the members of its group along `axis` (the
  `sizes_AxA` its plan would all_gather), from the layer's [A, A] traffic of that hop."""
  groups = mesh_lib.peer_table(axis, n, m)
  return np.stack([traffic_AxA[np.ix_(g, g)] for g in groups]).astype(np.int32)


class _Phases:
  """The phase programs of one layer on `mesh`, each a jitted shard_map over per-device blocks."""

  def __init__(self, cfg: MoEConfig, mesh):
    self.cfg, self.mesh = cfg, mesh
    self.n, self.m = mesh_lib.axis_sizes(mesh)
    self.sharded = NamedSharding(mesh, P(AXES))

  def put(self, array) -> jax.Array:
    """A [D * rows, ...] array, each device holding its block of rows."""
    return jax.device_put(array, self.sharded)

  def _map(self, body, n_args: int, check_vma: bool = True):
    return jax.jit(
      jax.shard_map(body, mesh=self.mesh, in_specs=(P(AXES),) * n_args, out_specs=P(AXES), check_vma=check_vma)
    )

  def exchange(self, axis, out_rows: int, direction: str, collective):
    """One hop's exchange over `axis` by its collective, as a plan from sizes [1, A, A] says: 'dispatch' sends
    rows [R, D] and their ids [R] (`path.plan_path`, `move_through`), 'combine' sends rows back
    (`path.move_back`)."""

    def send(operand, sizes, fill=0):
      forward, backward = plan_lib.ragged_args(sizes[0], jax.lax.axis_index(axis))
      args = forward if direction == "dispatch" else backward
      return collective_lib.exchange(operand, args, out_rows, axis, collective, fill=fill)

    if direction == "dispatch":
      return self._map(lambda rows, ids, sizes: (send(rows, sizes), send(ids, sizes, fill=-1)), 3)
    return self._map(send, 2)

  def ffn(self):
    """The expert FFN on rows [R, d] with group sizes [slots] and the local weights."""
    cfg = self.cfg

    def body(rows, sizes, w_in, w_out, *w_gate):
      return experts.expert_ffn(
        rows,
        sizes,
        w_in,
        w_out,
        w_gate[0] if w_gate else None,
        activation=cfg.activation,
        backend=cfg.expert_backend,
        dtype=jnp.dtype(cfg.dtype),
      )

    return self._map(body, 5 if cfg.gated else 4, not cfg.backend_kind.interprets_on(platform_lib.of_mesh(self.mesh)))


def measure_phases(params: dict, x: jax.Array, cfg: MoEConfig, mesh, warmup: int, repeats: Repeats | int) -> dict:
  """Median milliseconds of the layer forward on x [T, d] (sharded over the mesh) and of its phases, each timed
  `repeats` times (`moejax.study.repeats.timed`):
  {'layer_ms', 'layer_ms_min', 'layer_inter_node_ms', 'layer_intra_node_ms', 'layer_expert_ms', 'layer_other_ms'}."""
  layer = timed(lambda: moe_apply(params, x, cfg, mesh), warmup, repeats)
  _, aux = moe_apply(params, x, cfg, mesh)
  traffic = np.asarray(aux["traffic_rows"])
  counts = np.asarray(aux["expert_counts"])
  lay = layout(cfg, x.shape[0], mesh)
  ex = exchange_for(lay)
  phases = _Phases(cfg, mesh)
  n, m, devices = lay.n, lay.m, lay.n * lay.m
  d, slots = cfg.d_model, lay.slots
  rng = np.random.default_rng(0)
  rows_of = lambda count: phases.put(rng.standard_normal((devices * count, d)).astype(jnp.dtype(cfg.dtype)))
  median_ms = lambda fn: 1e3 * statistics.median(timed(fn, warmup, repeats))
  comm = {True: 0.0, False: 0.0}  # crosses nodes -> ms

  row_slots = cfg.choices_per_token * lay.sharding.copies(m) if lay.dedup else 1
  planned = path_lib.hop_sizes(ex.hops, ex.axis_sizes, lay.rows, row_slots, ex.collective, ex.buffer_rows, ex.dedup)
  for axis, hop, size in zip(ex.hops, traffic, planned):
    sizes = phases.put(hop_sizes(hop, axis, n, m))
    dispatch = phases.exchange(axis, size.out_rows, "dispatch", size.collective)
    combine = phases.exchange(axis, size.taken, "combine", size.collective)
    rows, back = rows_of(size.taken), rows_of(size.out_rows)
    ids = phases.put(np.zeros((devices * size.taken, row_slots), np.int32))
    comm[mesh_lib.crosses_nodes(axis, n)] += median_ms(lambda: dispatch(rows, ids, sizes))
    comm[mesh_lib.crosses_nodes(axis, n)] += median_ms(lambda: combine(back, sizes))
  received, sizes = planned[-1].bound, counts.reshape(devices, slots)  # the experts' entries (`path.grouped`)
  weights = [params["w_in"], params["w_out"]] + ([params["w_gate"]] if cfg.gated else [])
  ffn, rows, group_sizes = phases.ffn(), rows_of(received), phases.put(sizes.reshape(-1).astype(np.int32))
  expert_ms = median_ms(lambda: ffn(rows, group_sizes, *weights))
  layer_ms = 1e3 * statistics.median(layer)
  return {
    "layer_ms": layer_ms,
    "layer_ms_min": 1e3 * min(layer),
    "layer_inter_node_ms": comm[True],
    "layer_intra_node_ms": comm[False],
    "layer_expert_ms": expert_ms,
    "layer_other_ms": layer_ms - comm[True] - comm[False] - expert_ms,
  }
