"""The price of a compiled program on a topology: every collective it runs (`moejax.cost.program`) priced as NCCL runs
it (`moejax.cost.collectives`), and its compute from XLA's own counts.

  price(compiled, mesh, topology) -> ProgramPrice

Each collective instruction is priced per run, for all of its groups at once (groups running together share each
node's NICs), times its runs per program run:
- all-to-all, ragged all-to-all and collective-permute as one exchange (`collectives.all_to_all`): an all-to-all's
  send buffer split evenly over its group, a ragged one's at `ragged_fill` of its buffer (1: the buffer, an upper
  bound; a point's real traffic gives the fraction), a permute's block to its target;
- all-reduce, all-gather, reduce-scatter (and collective-broadcast, as an all-gather of its buffer) as NCCL's ring
  (`collectives.ring`) over the group's nodes and GPUs per node, `concurrent` the groups that share a node's NICs.
A device's node is its mesh position on every axis but 'gpu' (the mesh's intra-node axis). A collective whose runs
XLA does not state (`count` None) is refused, naming it: nothing is priced by a guess.

Compute is the roofline of `compiled.cost_analysis()`: max(flops / (peak_flops x compute_efficiency),
bytes accessed / memory_bw) per device (`price`), or with terms measured on the mesh at hand the sum over the
program's ops (`moejax.cost.program_ops`) of their runs x (a launch + their FLOPs or bytes at their category's
measured rate) (`price_measured`). `serial_s` adds compute and every collective (no overlap): the program's
schedule decides how much of the communication hides, a later term.
"""

import dataclasses

import numpy as np

from moejax.cost import collectives as collectives_lib
from moejax.cost import program as program_lib
from moejax.cost import program_ops, program_segments
from moejax.cost.topology import Topology

RING = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
EXCHANGE = ("all-to-all", "ragged-all-to-all", "collective-permute")
PRICED_KINDS = (*RING, "collective-broadcast", *EXCHANGE)
INTRA_NODE_AXIS = "gpu"


@dataclasses.dataclass(frozen=True)
class PricedCollective:
  """One collective instruction, its cost per run, and its seconds per program run (per_run x count)."""

  collective: program_lib.Collective
  per_run: collectives_lib.ExchangeCost

  @property
  def seconds(self) -> float:
    return self.per_run.time_s * self.collective.count


@dataclasses.dataclass(frozen=True)
class ProgramPrice:
  """collectives: one per instruction; compute_s: per device, the roofline of XLA's flops and bytes (`price`) or the
  sum over the program's ops (`price_measured`); flops, bytes_accessed: the counts it priced."""

  collectives: tuple[PricedCollective, ...]
  compute_s: float
  flops: float
  bytes_accessed: float

  @property
  def communication_s(self) -> float:
    return sum(p.seconds for p in self.collectives)

  @property
  def serial_s(self) -> float:
    return self.compute_s + self.communication_s

  def by_kind(self) -> dict[tuple[str, tuple[str, ...]], tuple[int, float]]:
    """{(kind, axes): (runs, seconds)} per program run."""
    table = {}
    for p in self.collectives:
      runs, seconds = table.get((p.collective.kind, p.collective.axes), (0, 0.0))
      table[(p.collective.kind, p.collective.axes)] = (runs + p.collective.count, seconds + p.seconds)
    return table

  def __str__(self) -> str:
    rows = [f"{'kind':<20}{'axes':<10}{'runs':>6}{'ms':>10}"]
    for (kind, axes), (runs, seconds) in sorted(self.by_kind().items()):
      rows.append(f"{kind:<20}{','.join(axes) or '-':<10}{runs:>6}{seconds * 1e3:>10.4f}")
    rows.append(f"{'communication':<36}{self.communication_s * 1e3:>10.4f}")
    rows.append(f"{'compute (roofline)':<36}{self.compute_s * 1e3:>10.4f}")
    return "\n".join(rows)


def node_ids(mesh, assignment) -> np.ndarray:
  """[devices] the node of each logical device id: its position on every mesh axis but 'gpu', flattened."""
  coords = np.asarray(program_lib._coordinates(mesh, assignment))  # pylint: disable=protected-access
  names = list(mesh.axis_names)
  keep = [i for i, name in enumerate(names) if name != INTRA_NODE_AXIS]
  if not keep:
    return np.zeros(len(coords), np.int64)
  shape = [mesh.devices.shape[i] for i in keep]
  return np.ravel_multi_index(tuple(coords[:, keep].T), shape)


def price_collective(
  c: program_lib.Collective, node_of: np.ndarray, topology: Topology, ragged_fill: float = 1.0
) -> collectives_lib.ExchangeCost:
  """One run of collective c (all its groups at once); node_of [devices]: each logical id's node."""
  if c.kind not in PRICED_KINDS:
    raise ValueError(f"collective {c.name!r}: kind {c.kind!r} has no price (priced: {', '.join(PRICED_KINDS)})")
  if c.kind in EXCHANGE:
    return _exchange(c, node_of, topology, ragged_fill)
  group = c.groups[0]
  nodes = len({int(node_of[i]) for i in group})
  gpus = max(np.unique(node_of[list(group)], return_counts=True)[1])
  crossing = [g for g in c.groups if len({int(node_of[i]) for i in g}) > 1]
  # Rings crossing nodes at once share each node's NICs: as many as a node has members of such groups, per group.
  concurrent = max(1, len(crossing) * nodes // max(1, len(np.unique(node_of)))) if crossing else 1
  kind = RING.get(c.kind, "all_gather")
  return collectives_lib.ring(kind, c.bytes, nodes, int(gpus), topology, concurrent)


def _exchange(c, node_of, topology, ragged_fill):
  """An all-to-all (send buffer split over the group) or a permute (block to its target) as one exchange."""
  devices = len(node_of)
  m = devices // len(np.unique(node_of))
  # collectives.all_to_all reads device s's node as s // m: order the devices by node first.
  order = np.argsort(node_of, kind="stable")
  flat = np.empty(devices, np.int64)
  flat[order] = np.arange(devices)
  bytes_AxA = np.zeros((devices, devices))
  group_AxA = np.zeros((devices, devices), bool)
  if c.kind == "collective-permute":
    for s, t in c.groups:
      bytes_AxA[flat[s], flat[t]] += c.bytes
      group_AxA[flat[s], flat[t]] = True
  else:
    fill = ragged_fill if c.kind == "ragged-all-to-all" else 1.0
    for g in c.groups:
      ids = flat[list(g)]
      group_AxA[np.ix_(ids, ids)] = True
      bytes_AxA[np.ix_(ids, ids)] = fill * c.bytes / len(g)
  return collectives_lib.all_to_all(bytes_AxA, group_AxA, m, topology)


def price_collectives(
  found: list[program_lib.Collective], node_of: np.ndarray, topology: Topology, ragged_fill: float = 1.0
) -> tuple[PricedCollective, ...]:
  """Every collective priced; refuses one whose runs per program run are unknown."""
  unknown = [c.name for c in found if c.count is None]
  if unknown:
    raise ValueError(f"collectives {unknown} run an unknown number of times per program run: cannot price them")
  return tuple(PricedCollective(c, price_collective(c, node_of, topology, ragged_fill)) for c in found)


def compute_seconds(cost: dict, topology: Topology) -> float:
  """The roofline of XLA's per-device counts (`program.program_cost`)."""
  rate = topology["peak_flops"] * topology["compute_efficiency"]
  return max(cost.get("flops", 0.0) / rate, cost.get("bytes accessed", 0.0) / topology["memory_bw"])


def price(compiled, mesh, topology: Topology, ragged_fill: float = 1.0) -> ProgramPrice:
  """The compiled program's collectives and compute on `topology` (module docstring)."""
  assignment = program_lib.device_assignment(compiled, mesh)
  found = program_lib.parse(compiled.as_text(), mesh, assignment)
  cost = program_lib.program_cost(compiled)
  return ProgramPrice(
    collectives=price_collectives(found, node_ids(mesh, assignment), topology, ragged_fill),
    compute_s=compute_seconds(cost, topology),
    flops=cost.get("flops", 0.0),
    bytes_accessed=cost.get("bytes accessed", 0.0),
  )


def control_collectives(compiled, mesh) -> dict:
  """The collectives of `compiled` that carry no rows (every kind but the exchanges: a layer's plan all-gathers and
  statistics all-reduces), JSON-ready with each logical id's node: what `control_seconds` prices on any topology.
  Their sizes depend on the mesh and the expert count, not on the tokens or the widths."""
  assignment = program_lib.device_assignment(compiled, mesh)
  found = [c for c in program_lib.parse(compiled.as_text(), mesh, assignment) if c.kind not in EXCHANGE]
  return {"collectives": [dataclasses.asdict(c) for c in found], "node_of": node_ids(mesh, assignment).tolist()}


def unpriced_exchanges(compiled, mesh, hops) -> list[program_lib.Collective]:
  """The exchanges of `compiled` that no hop of `hops` (the traffic model's: each a mesh axis or a tuple of axes)
  prices: an all-to-all or permute over axes outside every hop's (a permute of a ring over both axes may pair devices
  of one axis: within a hop's axes is covered). The rest of the program's collectives are `control_collectives`."""
  priced = [set(h) if isinstance(h, tuple) else {h} for h in hops]
  assignment = program_lib.device_assignment(compiled, mesh)
  found = program_lib.parse(compiled.as_text(), mesh, assignment)
  return [c for c in found if c.kind in EXCHANGE and c.axes and not any(set(c.axes) <= axes for axes in priced)]


def control_seconds(record: dict, topology: Topology) -> float:
  """Seconds per run of the collectives `control_collectives` recorded, on `topology`."""
  found = [
    program_lib.Collective(**{**c, "axes": tuple(c["axes"]), "groups": tuple(tuple(g) for g in c["groups"])})
    for c in record["collectives"]
  ]
  return sum(p.seconds for p in price_collectives(found, np.asarray(record["node_of"]), topology))


def price_measured(compiled, mesh, terms, op_seconds: dict | None = None) -> ProgramPrice:
  """The compiled program priced with terms measured on the mesh at hand (`moejax.study.program_calibration`):
  each collective alpha + its bytes' seconds per run (`Terms.byte_seconds`), from `terms.per_kind[(kind, axes)]`
  (alpha `terms.chained`'s for one right after another collective), plus the cost of each operand past its first (`Terms.collective_seconds`: a
  combined all-reduce of a step's gradients), plus its devices' wait for one another after the compute before it
  (`program_segments.arrival_seconds` of its `segment_seconds`, at `Terms.arrival_points` of its kind), plus, at the
  program's first collective (`first_collective`), once per program run, the job's processes' launch skew
  (`Terms.skew` of its kind and axes); compute per op
  (`moejax.cost.program_ops`): the program's call plus each op's runs x (launch + its FLOPs or bytes at its
  category's rate, `terms.op_seconds`; an op named in `op_seconds`, {op name: seconds per run}, at that:
  `moejax.study.op_timing`'s, each op timed alone). A collective over no axis (groups of one device) costs nothing; one of a kind and axes
  the terms lack is refused, naming it, and so is an op or collective whose runs are unknown."""
  assignment = program_lib.device_assignment(compiled, mesh)
  hlo = compiled.as_text()
  found, ops = program_lib.parse(hlo, mesh, assignment), program_ops.parse(hlo)
  unknown = [c.name for c in found if c.count is None] + [o.name for o in ops if o.count is None]
  missing = sorted({(c.kind, c.axes) for c in found if c.axes and (c.kind, c.axes) not in terms.per_kind})
  if unknown or missing:
    raise ValueError(
      f"cannot price collectives or ops {unknown} (runs unknown) or kinds and axes {missing} (not measured; "
      f"measured: {sorted(terms.per_kind)})"
    )
  segments = segment_seconds(hlo, ops, terms, op_seconds)
  first = first_collective(segments, found)
  priced = []
  for c in found:
    wait = program_segments.arrival_seconds(terms.arrival_points(c.kind), segments[c.name])
    seconds = terms.collective_seconds(c.kind, c.axes, c.bytes, c.operands, c.chained) + wait if c.axes else 0.0
    if c.name == first:  # once per program run: the processes' launch skew, spread over its runs
      seconds += terms.skew.get((c.kind, c.axes), 0.0) / c.count
    beta = terms.byte_seconds(c.kind, c.axes, c.bytes) if c.axes else 0.0
    cost = collectives_lib.ExchangeCost(seconds, seconds - beta, 0.0, beta, 0, 0, 0.0, 0.0, False)
    priced.append(PricedCollective(c, cost))
  compute = terms.call_s + sum(compute_by_category(ops, terms, op_seconds).values())
  flops, nbytes = sum(o.count * o.flops for o in ops), sum(o.count * o.bytes for o in ops)
  return ProgramPrice(tuple(priced), compute, flops, nbytes)


def first_collective(in_order, found: list[program_lib.Collective]) -> str | None:
  """The name of the first collective over some mesh axis the program runs from its entry; `in_order`: the program's
  collectives' names in the order it runs them (`program_segments.segments`' keys, or `segment_seconds`'); None
  without one."""
  spanning = {c.name for c in found if c.axes}
  return next((name for name in in_order if name in spanning), None)


def compute_by_category(ops: list[program_ops.Op], terms, op_seconds: dict | None = None) -> dict[str, float]:
  """{category: seconds per program run} of `ops` (`program_ops.ops`) at measured `terms` (an op in `op_seconds`
  at its own), their launches included."""
  table = {}
  for o in ops:
    table[o.category] = table.get(o.category, 0.0) + o.count * one_run(o, terms, op_seconds)
  return table


def one_run(o: program_ops.Op, terms, op_seconds: dict | None = None) -> float:
  """Seconds of one run of op `o`: its own time in `op_seconds` ({op name: seconds}) where timed, else its
  category's price at `terms`."""
  if op_seconds and o.name in op_seconds:
    return op_seconds[o.name]
  return terms.op_seconds(o.category, o.flops, o.bytes)


def segment_seconds(hlo: str, ops: list[program_ops.Op], terms, op_seconds: dict | None = None) -> dict[str, float]:
  """{collective's name: the seconds, at `terms` (`one_run`), of the ops its computation runs before it since the
  collective before (`program_segments.segments`)}."""
  by_name = {o.name: o for o in ops}
  return {
    name: sum(one_run(o, terms, op_seconds) for o in (by_name[n] for n in segment if n in by_name))
    for name, segment in program_segments.segments(hlo).items()
  }
