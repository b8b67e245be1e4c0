"""Cluster topologies: link bandwidths, per-message latencies and compute rates, each with its source.

Every number is a `Param`: a value in SI units (bytes/s, seconds, FLOP/s), where it comes from,
and its kind: 'datasheet' (a vendor specification), 'paper' (stated in a cited paper), 'assumed'
(a stated guess, or another model's constant), 'fitted' (least squares on cited measurements; the
source names them, the value and the residual), 'measured' (timed by us), 'given' (set by a user).
Bandwidths are per direction: vendors quote NVLink as a bidirectional total, which is halved here.
"""

import dataclasses

KINDS = ("datasheet", "paper", "assumed", "fitted", "measured", "given")
UNITS = {
  "gpus_per_node": (1, ""),
  "intra_bw": (1e9, "GB/s"),
  "nic_bw": (1e9, "GB/s"),
  "intra_latency": (1e-6, "us"),
  "inter_latency": (1e-6, "us"),
  "launch": (1e-6, "us"),
  "peak_flops": (1e12, "TFLOP/s"),
  "compute_efficiency": (1, ""),
  "memory_bw": (1e9, "GB/s"),
}


@dataclasses.dataclass(frozen=True)
class Param:
  """One number of a topology, with its source and kind (one of KINDS)."""

  value: float
  source: str
  kind: str

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Param kind {self.kind!r} is not one of {KINDS}")
    if not self.source:
      raise ValueError(f"Param {self.value} has no source")


@dataclasses.dataclass(frozen=True)
class Topology:
  """Nodes of `gpus_per_node` GPUs joined by intra-node links; nodes joined by NICs.

  gpus_per_node: GPUs per node (the largest 'gpu' mesh axis the topology holds).
  intra_bw: bytes/s one GPU sends (and at the same time receives) to the GPUs of its node.
  nic_bw: bytes/s one node sends (and at the same time receives) over all its NICs, shared by
    its GPUs.
  intra_latency / inter_latency: seconds per point-to-point message inside a node / between nodes.
  launch: seconds per collective call, paid once per exchange.
  peak_flops: dense 16-bit tensor-core FLOP/s of one GPU.
  compute_efficiency: fraction of peak_flops the expert matmuls reach when no measured rate is given.
  memory_bw: bytes/s of one GPU's memory: the rate of the layer's memory-bound non-expert phases
    (`cost.phases`).
  """

  name: str
  gpus_per_node: Param
  intra_bw: Param
  nic_bw: Param
  intra_latency: Param
  inter_latency: Param
  launch: Param
  peak_flops: Param
  compute_efficiency: Param
  memory_bw: Param

  def params(self) -> dict[str, Param]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}

  def __getitem__(self, field: str) -> float:
    return self.params()[field].value


_NCCL = "NCCL src/graph/tuning.cc (2.x) Ring/Simple"
LAUNCH = Param(8.4e-6, f"{_NCCL} baseLat = 8.4 us: NCCL's own tuning constant, not a measurement", "assumed")
NVLINK_LATENCY = Param(3.4e-6, f"{_NCCL} hwLat[NVLINK] = 3.4 us: NCCL's tuning constant", "assumed")
PCIE_LATENCY = Param(5.7e-6, f"{_NCCL} hwLat[PCI] = 5.7 us: NCCL's tuning constant", "assumed")
NET_LATENCY = Param(9.6e-6, f"{_NCCL} hwLat[NET] = 9.6 us: NCCL's tuning constant", "assumed")
EFFICIENCY = Param(0.5, "assumed: half of peak for expert matmuls; pass a measured rate instead", "assumed")
A100_PEAK = Param(312e12, "A100 SXM4 datasheet: 312 TFLOP/s dense FP16/BF16 tensor", "datasheet")
H100_PEAK = Param(989e12, "H100 SXM5 datasheet: 989 TFLOP/s dense BF16 tensor (1979 with sparsity)", "datasheet")
A100_NVLINK = "A100 SXM4 datasheet: NVLink 600 GB/s per GPU bidirectional, 300 GB/s per direction"
A100_40GB_HBM = Param(1555e9, "A100 datasheet: 40 GB HBM2, 1,555 GB/s", "datasheet")
H100_HBM = Param(3.35e12, "H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s", "datasheet")

P4D_EFA = Topology(
  name="p4d_efa",
  gpus_per_node=Param(8, "SMILE Sec. 4.1 'Hardware': AWS P4d nodes with 8 A100 GPUs", "paper"),
  intra_bw=Param(300e9, f"{A100_NVLINK}; SMILE Sec. 1 and 4.4: NVSwitch 600 GB/s inside a P4d", "datasheet"),
  nic_bw=Param(50e9, "SMILE Sec. 1 and 4.1: EFA 400 Gbps between P4d nodes = 50 GB/s per node", "paper"),
  intra_latency=NVLINK_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=A100_PEAK,
  compute_efficiency=EFFICIENCY,
  memory_bw=A100_40GB_HBM,
)

DGX_H100_IB = Topology(
  name="dgx_h100_ib",
  gpus_per_node=Param(8, "DGX H100 datasheet: 8x H100 SXM5", "datasheet"),
  intra_bw=Param(
    450e9, "H100 SXM5 datasheet: NVLink 900 GB/s per GPU bidirectional, 450 GB/s per direction", "datasheet"
  ),
  nic_bw=Param(400e9, "DGX H100 datasheet: 8x ConnectX-7 400 Gb/s InfiniBand = 400 GB/s per node", "datasheet"),
  intra_latency=NVLINK_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=H100_PEAK,
  compute_efficiency=EFFICIENCY,
  memory_bw=H100_HBM,
)

H800_NVLINK = Topology(
  name="h800_nvlink",
  gpus_per_node=Param(8, "Comet Sec. 5.1: one server with 8 H800 80 GB joined by NVLink", "paper"),
  intra_bw=Param(
    200e9,
    "H800 SXM5 specification: NVLink 400 GB/s bidirectional, 200 GB/s per direction "
    "(Comet Sec. 5.1 names NVLink without a rate)",
    "datasheet",
  ),
  nic_bw=Param(
    400e9, "assumed: Comet runs one node only; a DGX H100's 8x 400 Gb/s stands in for meshes with more nodes", "assumed"
  ),
  intra_latency=NVLINK_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=Param(989e12, "H800 SXM5 specification: the H100 SXM5's 989 TFLOP/s dense BF16", "datasheet"),
  compute_efficiency=EFFICIENCY,
  memory_bw=Param(3.35e12, "H800 SXM5 specification: the H100 SXM5's HBM3, 3.35 TB/s", "datasheet"),
)

A100_IB100 = Topology(
  name="a100_ib100",
  gpus_per_node=Param(4, "Lina Sec. 7.1: four nodes of 4 A100 40 GB", "paper"),
  intra_bw=Param(300e9, f"assumed: Lina does not name its intra-node link; {A100_NVLINK}", "assumed"),
  nic_bw=Param(12.5e9, "Lina Sec. 7.1: 100 Gbps InfiniBand per node = 12.5 GB/s", "paper"),
  intra_latency=NVLINK_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=A100_PEAK,
  compute_efficiency=EFFICIENCY,
  memory_bw=A100_40GB_HBM,
)

L20_PCIE = Topology(
  name="l20_pcie",
  gpus_per_node=Param(8, "Comet Sec. 5.4: 8 L20 46 GB joined by PCIe bridges", "paper"),
  intra_bw=Param(25e9, "Comet Sec. 5.4: GPU-to-GPU bandwidth 'around 25 GB/s as tested'", "paper"),
  nic_bw=Param(12.5e9, "assumed: Comet runs one node only; a 100 Gb/s NIC stands in for more nodes", "assumed"),
  intra_latency=PCIE_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=Param(
    119.5e12,
    "assumed: 119.5 TFLOP/s FP16 tensor, the figure resellers quote for the L20; "
    "not checked against an NVIDIA datasheet",
    "assumed",
  ),
  compute_efficiency=EFFICIENCY,
  memory_bw=Param(
    864e9, "assumed: NVIDIA L20 product brief, GDDR6 864 GB/s; not checked against a datasheet", "assumed"
  ),
)

RTX4090_PCIE = Topology(
  name="rtx4090_pcie",
  gpus_per_node=Param(8, "Parm Table II, testbed A: one server with 8 RTX 4090 24 GB", "paper"),
  intra_bw=Param(
    31.5e9,
    "Parm Table II / Sec. VI-A: GPUs linked through PCIe 4.0 x16; PCIe 4.0 specification: "
    "16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s per direction (a link rate, not a measured copy rate)",
    "datasheet",
  ),
  nic_bw=Param(
    12.5e9,
    "assumed: testbed A is one server (Parm Table II: network '-'); a 100 Gb/s NIC stands in "
    "for meshes with more nodes",
    "assumed",
  ),
  intra_latency=PCIE_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=Param(
    165.2e12,
    "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: 165.2 TFLOP/s peak "
    "FP16 tensor with FP32 accumulate (dense)",
    "datasheet",
  ),
  compute_efficiency=EFFICIENCY,
  memory_bw=Param(
    1008e9, "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: GDDR6X 1,008 GB/s", "datasheet"
  ),
)

RTX2080TI_IB100 = Topology(
  name="rtx2080ti_ib100",
  gpus_per_node=Param(4, "Parm Table II, testbed B: servers of 4 RTX 2080 Ti 11 GB (32 GPUs = 8 servers)", "paper"),
  intra_bw=Param(
    15.75e9,
    "Parm Table II: PCIe 3.0 x16; PCIe 3.0 specification: 8 GT/s x 16 lanes x 128b/130b "
    "= 15.75 GB/s per direction (a link rate, not a measured copy rate)",
    "datasheet",
  ),
  nic_bw=Param(12.5e9, "Parm Table II: Mellanox MT27800 (ConnectX-5) 100 Gb/s per server = 12.5 GB/s", "paper"),
  intra_latency=PCIE_LATENCY,
  inter_latency=NET_LATENCY,
  launch=LAUNCH,
  peak_flops=Param(
    53.8e12,
    "NVIDIA Turing architecture whitepaper, GeForce RTX 2080 Ti (reference clocks): "
    "53.8 TFLOP/s peak FP16 tensor with FP32 accumulate",
    "datasheet",
  ),
  compute_efficiency=EFFICIENCY,
  memory_bw=Param(616e9, "NVIDIA Turing architecture whitepaper, GeForce RTX 2080 Ti: GDDR6 616 GB/s", "datasheet"),
)

PRESETS = {t.name: t for t in (P4D_EFA, DGX_H100_IB, H800_NVLINK, A100_IB100, L20_PCIE, RTX4090_PCIE, RTX2080TI_IB100)}


def get(name: str) -> Topology:
  """A preset by name."""
  if name not in PRESETS:
    raise ValueError(f"unknown topology {name!r}; presets: {sorted(PRESETS)}")
  return PRESETS[name]


def custom(base: Topology | str, name: str = "custom", **values) -> Topology:
  """`base` (a preset or its name) with fields replaced: floats become 'given' Params, Params stay."""
  base = get(base) if isinstance(base, str) else base
  unknown = sorted(set(values) - set(base.params()))
  if unknown:
    raise ValueError(f"unknown topology field(s) {unknown}; fields: {sorted(base.params())}")
  params = {k: v if isinstance(v, Param) else Param(float(v), "given by the user", "given") for k, v in values.items()}
  return dataclasses.replace(base, name=name, **params)


def parse_overrides(text: str) -> dict[str, float]:
  """'nic_bw=25e9,inter_latency=2e-5' -> {'nic_bw': 25e9, 'inter_latency': 2e-5} (for flags)."""
  overrides = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"topology override {item!r} is not field=value")
    overrides[key.strip()] = float(value)
  return overrides


def describe(topology: Topology) -> str:
  """One line per field: value with unit, kind, source."""
  lines = [f"topology {topology.name}"]
  for field, p in topology.params().items():
    scale, unit = UNITS[field]
    lines.append(f"  {field:18s} {p.value / scale:10.4g} {unit:8s} {p.kind:9s} {p.source}")
  return "\n".join(lines)
