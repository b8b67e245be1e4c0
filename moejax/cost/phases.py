"""The layer's non-expert phases (routing, sort, the gather into expert order, the weighted scatter back), priced
from measured per-row costs.

What the layer does outside its exchanges and expert GEMMs is memory-bound work on every row it routes: the
router's logits and top-k, a sort by expert, a gather of the rows into expert order before the dispatch and a
weighted scatter-add after the combine. `moejax.study.phase_timing` timed it (in the H100 run of 2026-11-23) as
the whole layer minus its phases each timed as a program of its own ('other'; it now splits one profiled run); the
H100 run (benchmarks/results/2026-11-23-h100/layer.json, mesh 1x1) records it per model.
It is priced here as seconds per byte of routed row (rows x d_model x bytes per element), so one measurement
carries over to other widths and row counts on a GPU with the same memory bandwidth (the H800 has the H100 SXM5's
HBM3, 3.35 TB/s).

The padded collective's cases are used (a case's 'collective', or 'transport' in records written before the
split): their 'other' is the non-expert work alone, while the ragged cases on one device fold a single-device ragged exchange of about 20 ms into the timed phases and leave a negative remainder.

Who pays it (Comet, arXiv 2502.19811): its baselines run these phases as kernels of their own (Fig. 11 counts
'local token indexing, dispatch and combine' as computation; FasterMoE's 'customized Scatter/Gather operators' and
'local indexing lengthens compute time'), while Comet's fused kernels read the rows by index inside layer0's GEMM
(Sec. 3.1: a gather-GEMM, no pre-permuted input) and do the top-k reduction in layer1's epilogue before writing
to the destination (Sec. 3.2), so the gather and the scatter are not separate passes. `overlap.LayerShape`'s
`non_expert_s` is charged to the sequential and chunked schedules and not to comet (an upper bound of what comet
saves: the routing and sort it still runs are inside the measured remainder and are not split out of it).

`for_topology` carries the H100 measurement (`H100_MEASURED`, Mixtral widths) to another GPU by its memory
bandwidth; the Comet validation and the scaling sweep both price with it. The per-byte cost is not one constant
across shapes: the same run gives 1.0e-11 s/byte at Qwen2-MoE's widths (d 2048, E 64, top-4) against 2.7e-12 at
Mixtral's (d 4096, E 8, top-2), since routing and the sort grow with E and k, not with d; priced at Mixtral's, a
fine-grained layer's non-expert time is an underestimate.
"""

import dataclasses
import json

import numpy as np

from moejax.cost.topology import H100_HBM, Topology


@dataclasses.dataclass(frozen=True)
class RowCost:
  """seconds_per_byte: non-expert seconds per byte of routed row (rows x d_model x element bytes)."""

  seconds_per_byte: float
  source: str

  def seconds(self, rows: float, d_model: int, element_bytes: int = 2) -> float:
    return float(rows) * d_model * element_bytes * self.seconds_per_byte


def from_layer_json(path, model: str, collective: str = "padded", name: str | None = None) -> RowCost:
  """The mean over expert backends of layer_other_ms / (rows x d_model x 2 bytes) of `model`'s `collective` cases
  in a `phase_timing` layer record (bf16 rows)."""
  with open(path) as f:
    record = json.load(f)
  cases = [c for c in record["cases"] if c["model"] == model and c.get("collective", c.get("transport")) == collective]
  if not cases:
    raise ValueError(f"{path} has no {collective!r} case of model {model!r}")
  per_byte = [c["phases_ms"]["layer_other_ms"] * 1e-3 / (c["rows"] * c["d_model"] * 2) for c in cases]
  if min(per_byte) <= 0:
    raise ValueError(f"{path}: a non-positive 'other' remainder in {model!r} {collective!r}: {per_byte}")
  backends = ", ".join(c["expert_backend"] for c in cases)
  return RowCost(
    float(np.mean(per_byte)),
    f"measured: {name or path} {model} {collective} ({backends}) layer_other_ms / routed row bytes on "
    f"{record.get('device', 'unknown device')}, mean of {len(cases)}",
  )


H100_LAYER_JSON = "benchmarks/results/2026-11-23-h100/layer.json"
# from_layer_json(H100_LAYER_JSON, "mixtral_8x7b"); tests/test_overlap_cost.py checks it against the file.
H100_MEASURED = RowCost(
  2.679197117990651e-12,
  f"measured: {H100_LAYER_JSON} mixtral_8x7b padded (ragged_dot, "
  "pallas) layer_other_ms / routed row bytes on NVIDIA H100 80GB HBM3, mean of 2",
)


def for_topology(topology: Topology, measured: RowCost = H100_MEASURED, measured_bw: float = H100_HBM.value) -> RowCost:
  """`measured` (taken on a GPU of memory bandwidth `measured_bw`) carried to `topology`'s GPU: memory-bound work
  scales with 1 / memory bandwidth."""
  scale = measured_bw / topology.memory_bw.value
  if scale == 1:
    return measured
  return RowCost(
    measured.seconds_per_byte * scale,
    f"{measured.source}, x {scale:.2f} for memory bandwidth ({topology.memory_bw.source})",
  )
