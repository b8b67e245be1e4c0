"""The cost model calibrated on a cluster: its all-to-all terms fitted to exchanges timed there, its expert rate and
non-expert cost taken from a layer timed there.

An `Exchange` is one timed all-to-all: every device of an n x m mesh sends `rows_per_peer` rows of `row_bytes` to
each other member of its group along `axis` ('gpu', 'node', or 'both' at once). The model prices it as
`collectives.all_to_all` does,

  t = launch + intra messages x intra_latency + inter messages x inter_latency
        + max(busiest GPU's intra-node bytes / intra_bw, busiest node's NIC bytes / nic_bw),

which is linear in (launch, intra_latency, inter_latency, 1 / intra_bw, 1 / nic_bw) for an exchange along one axis
(one bandwidth term). `fit_topology` fits those terms to the one-axis exchanges by non-negative least squares on
relative residuals (`calibrate.fit_terms`' weighting) and holds out the exchanges along both axes, whose max() of
the two bandwidth terms the fit never saw: their errors test the model. Terms the exchanges cannot separate keep
the base topology's values (no 'node' exchanges: the inter-node terms; one group size: launch, then set to 0 and
folded into the per-message latencies).

A record (`load`) is a sweep's calibration.json (`moejax.study.calibration`: exchanges, and a layer timed on one
device at the model's widths, whose expert FFN gives the device rate and whose remainder gives the non-expert
seconds per routed byte, as `phases.from_layer_json` reads the H100 run) or experiments/bench_collectives.py's
collectives.json (exchanges only).
"""

import dataclasses
import json

import numpy as np
from scipy import optimize

from moejax.cost import collectives, phases
from moejax.cost import model as cost_model
from moejax.cost import topology as topology_lib
from moejax.runtime import mesh as mesh_lib

AXES = {"gpu": mesh_lib.GPU, "node": mesh_lib.NODE, "both": mesh_lib.AXES}
TERMS = ("launch", "intra_latency", "inter_latency", "intra_bw", "nic_bw")  # the topology's fields, in column order


@dataclasses.dataclass(frozen=True)
class Exchange:
  """One timed all-to-all (module docstring); median_s: its median seconds."""

  axis: str
  nodes: int
  gpus_per_node: int
  rows_per_peer: int
  row_bytes: int
  median_s: float

  def cost(self, topology: topology_lib.Topology) -> collectives.ExchangeCost:
    """The model's price of this exchange on `topology`."""
    n, m = self.nodes, self.gpus_per_node
    group = mesh_lib.same_group(AXES[self.axis], n, m)
    return collectives.all_to_all(group * float(self.rows_per_peer * self.row_bytes), group, m, topology)

  def features(self, topology: topology_lib.Topology) -> np.ndarray:
    """[5]: the coefficients of TERMS' (launch, latencies, seconds per byte) in the model's time."""
    c = self.cost(topology)
    return np.array([1.0, c.messages_intra, c.messages_inter, c.intra_bytes, c.nic_bytes])


@dataclasses.dataclass(frozen=True)
class Calibration:
  """topology: the base with the fitted terms; rate: (FLOP/s, source) of the timed expert FFN, or None; row_cost:
  the timed non-expert cost, or None; nodes / gpus_per_node: the most the timed exchanges spanned (beyond them a
  modelled point is extrapolated); fit: the fitted values, residuals and held-out errors (`fit_topology`)."""

  topology: topology_lib.Topology
  rate: tuple[float, str] | None
  row_cost: phases.RowCost | None
  nodes: int
  gpus_per_node: int
  fit: dict

  def extrapolates(self, nodes: int, gpus_per_node: int) -> bool:
    """Whether a point of this shape lies beyond what was timed."""
    return nodes > self.nodes or gpus_per_node > self.gpus_per_node


def fit_topology(
  exchanges: list[Exchange], base: topology_lib.Topology, name: str
) -> tuple[topology_lib.Topology, dict]:
  """`base` with the TERMS the one-axis `exchanges` determine replaced by 'fitted' Params (value, residual and
  the record `name` in their source); returns it and the fit: {'values': {term: value}, 'fitted': terms fitted,
  'relative_residuals', 'rms_relative' (of the fitted exchanges), 'held_out': [{axis, nodes, gpus_per_node,
  rows_per_peer, measured_s, model_s, error}] (model / measured - 1 on the fitted topology)}."""
  fitted_on = [e for e in exchanges if e.axis != "both"]
  if not fitted_on:
    raise ValueError(f"{name}: no exchange along one axis ('gpu' or 'node') to fit")
  features = np.stack([e.features(base) for e in fitted_on])
  times = np.array([e.median_s for e in fitted_on])
  active = [i for i in range(len(TERMS)) if np.any(features[:, i])]
  latency = [i for i in active if i < 3]
  if np.linalg.matrix_rank(features[:, latency]) < len(latency):  # one group size: launch and latency inseparable
    active.remove(0)
  weighted = features[:, active] / times[:, None]
  scale = np.linalg.norm(weighted, axis=0)
  solution, _ = optimize.nnls(weighted / scale, np.ones_like(times))
  coefficients = np.zeros(len(TERMS))
  coefficients[active] = solution / scale
  relative = (times - features @ coefficients) / times
  rms = float(np.sqrt(np.mean(relative**2)))
  values = {TERMS[i]: float(coefficients[i]) for i in active}
  for term in ("intra_bw", "nic_bw"):  # fitted as seconds per byte
    if term in values:
      values[term] = 1.0 / values[term] if values[term] > 0 else float("inf")
  source = (
    f"fitted: non-negative least squares on {len(fitted_on)} one-axis all-to-alls timed in {name} "
    f"(rms relative residual {rms:.1%})"
  )
  params = {term: topology_lib.Param(value, source, "fitted") for term, value in values.items()}
  if 0 not in active:
    params["launch"] = topology_lib.Param(
      0.0,
      f"fitted: 0, folded into the per-message latencies ({name} times "
      "one group size per axis: the two are not separable)",
      "fitted",
    )
    values["launch"] = 0.0
  topology = topology_lib.custom(base, name=f"{base.name}+fitted", **params)
  held_out = [
    dict(
      axis=e.axis,
      nodes=e.nodes,
      gpus_per_node=e.gpus_per_node,
      rows_per_peer=e.rows_per_peer,
      measured_s=e.median_s,
      model_s=e.cost(topology).time_s,
      error=e.cost(topology).time_s / e.median_s - 1.0,
    )
    for e in exchanges
    if e.axis == "both"
  ]
  return topology, dict(
    values=values, fitted=sorted(values), relative_residuals=relative.tolist(), rms_relative=rms, held_out=held_out
  )


def exchanges_from_bench(record: dict) -> list[Exchange]:
  """The all-to-alls of an experiments/bench_collectives.py record: 'flat' (`rows_per_peer` to every device: along
  both axes, or along 'gpu' on one node) and 'node_a2a' (each device's D x rows rows split evenly over the n
  members of its 'node' group: m x rows to each)."""
  n, m = record["mesh"]
  row_bytes = record["d"] * np.dtype(record["dtype"]).itemsize
  per_peer = {"flat": ("both" if n > 1 else "gpu", 1), "node_a2a": ("node", m)}
  return [
    Exchange(per_peer[r["variant"]][0], n, m, r["rows_per_peer"] * per_peer[r["variant"]][1], row_bytes, r["median_s"])
    for r in record["results"]
    if r["variant"] in per_peer and "median_s" in r
  ]


def layer_terms(layer: dict, name: str) -> tuple[tuple[float, str], phases.RowCost | None]:
  """(device rate, non-expert row cost) of a layer timed on one device (`moejax.study.calibration.time_layer`):
  its expert FLOPs over its expert FFN's time, and its remainder over its routed rows' bytes (None where the
  remainder is not positive: the timed phases took the whole layer)."""
  flops = float(cost_model.expert_flops(layer["rows"], layer["d_model"], layer["d_ff"], layer["gated"]))
  rate = (
    flops / (layer["layer_expert_ms"] * 1e-3),
    f"measured: {name} expert FFN of {layer['rows']} rows at d {layer['d_model']}, f {layer['d_ff']} on "
    f"{layer['device']}",
  )
  other_s = layer["layer_other_ms"] * 1e-3
  if other_s <= 0:
    return rate, None
  per_byte = other_s / (layer["rows"] * layer["d_model"] * layer["itemsize"])
  return rate, phases.RowCost(per_byte, f"measured: {name} layer_other_ms / routed row bytes on {layer['device']}")


def load(path: str, base: topology_lib.Topology, name: str | None = None) -> Calibration:
  """The calibration in the record at `path` (module docstring) on top of `base`."""
  name = name or path
  with open(path) as f:
    record = json.load(f)
  if "exchanges" in record:
    exchanges = [Exchange(**e) for e in record["exchanges"]]
  elif "results" in record:
    exchanges = exchanges_from_bench(record)
  else:
    raise ValueError(f"{path} is neither a sweep's calibration.json nor a bench_collectives record")
  topology, fit = fit_topology(exchanges, base, name)
  rate, row_cost = layer_terms(record["layer"], name) if "layer" in record else (None, None)
  nodes = max([e.nodes for e in exchanges if e.axis != "gpu"], default=1)
  return Calibration(topology, rate, row_cost, nodes, max(e.gpus_per_node for e in exchanges), fit)
