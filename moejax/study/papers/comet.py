"""Comet (arXiv 2502.19811) against `moejax.cost.overlap`: a Mixtral 8x7B
layer on 8 H800 (EP 8) and 8 L20 under the sequential, chunked and comet schedules, against Comet's
hidden-communication shares (Fig. 11) and single-layer speedups (Fig. 10, Fig. 14).

Setting, Fig. 10: one MoE layer, EP 8 on one node of
8 H800, Mixtral 8x7B's experts (Table 2: N 4096, K 14336, E 8, top-2; SiLU-gated), M tokens in all (M / 8 per
device), M swept; the text does not list the M values, 4096..16384 are the values it names (Sec. 3.2.2).
"""

import numpy as np

from moejax.cost import model, overlap, phases, traffic
from moejax.cost import topology as topology_lib
from moejax.models import presets
from moejax.runtime import mesh as mesh_lib
from moejax.study.papers import ROOT, display_path, fidelity_row

RATE_JSON = ROOT / "benchmarks/results/2026-11-23-h100/kernels-mixtral_8x7b.json"  # dense GEMM TFLOP/s on an H100

_MIXTRAL = presets.expert_shape("mixtral_8x7b")  # Comet's Table 2 shape is Mixtral 8x7B's published one
COMET_MIXTRAL = dict(
  d_model=_MIXTRAL["d_model"], d_ff=_MIXTRAL["d_ff"], experts=_MIXTRAL["num_experts"], top_k=_MIXTRAL["top_k"]
)
COMET_TOKENS = (4096, 8192, 16384)
COMET_CHUNKS = (2, 4, 8)  # chunks (Tutel's searched pipeline degree) and column blocks of comet
COMET_PAPER = {  # each from the paper's text, at the figure or section its source names
  "hidden_comet": (0.865, "Comet Fig. 11 (EP 8, M 16384): 86.5% of communication hidden on average"),
  "hidden_tutel": (0.686, "Comet Fig. 11: Tutel 68.6%"),
  "hidden_fastermoe": (0.292, "Comet Fig. 11: FasterMoE 29.2% (a pipeline degree of 2, Related Work)"),
  "layer_speedup_h800": (
    (1.28, 2.37),
    "Comet Fig. 10 / Sec. 5.3: 1.28x-2.37x over the baselines on average, single layer, EP 8, M varied",
  ),
  "layer_speedup_l20": (
    (1.19, 1.46),
    "Comet Fig. 14 right / Sec. 5.4: 1.19x-1.46x on 8 L20 over PCIe (E 8, top-4, M 8192, EP x TP = 8)",
  ),
}


def comet_layer(topology, tokens: int, top_k: int, rate: tuple[float, str]):
  """(Exchanges, LayerShape) of the Mixtral layer on one node of 8 GPUs, EP 8, uniform routing (Comet
  Fig. 14 left's std 0: every expert gets M top_k / E rows), bf16 rows."""
  gpus, shape = 8, COMET_MIXTRAL
  rows = traffic.uniform_traffic(1, gpus, mesh_lib.AXES, tokens // gpus * top_k // gpus)[None]
  exchanges = overlap.Exchanges(rows, (mesh_lib.AXES,), (1, gpus), shape["d_model"] * 2, topology, device=0)
  routed_rows = tokens // gpus * top_k  # token choices this device routes (M / W tokens before dispatch)
  layer = overlap.LayerShape(
    (tokens * top_k / shape["experts"],),
    shape["d_model"],
    shape["d_ff"],
    gated=True,
    rate=rate[0],
    non_expert_s=phases.for_topology(topology).seconds(routed_rows, shape["d_model"]),
  )
  return exchanges, layer


def comet_schedules(topology, tokens: int, top_k: int, rate) -> dict:
  """Every schedule's ScheduleCost: sequential, chunked at each C, comet at each block count; and the best
  chunked and comet."""
  exchanges, layer = comet_layer(topology, tokens, top_k, rate)
  costs = {"sequential": overlap.price_schedule("sequential", exchanges, layer)}
  for c in COMET_CHUNKS:
    costs[f"chunked_{c}"] = overlap.price_schedule("chunked", exchanges, layer, c)
  for c in (1,) + COMET_CHUNKS:
    costs[f"comet_{c}"] = overlap.price_schedule("comet", exchanges, layer, c)
  for kind in ("chunked", "comet"):
    costs[f"{kind}_best"] = min((v for k, v in costs.items() if k.startswith(kind + "_")), key=lambda v: v.time_s)
  return costs


def h800_rate_of(rate_json: str) -> tuple[float, str]:
  """(FLOP/s, its source) of the H800's expert GEMMs: measured in `rate_json`, or ('') datasheet peak x efficiency."""
  if rate_json:
    return model.measured_rate(rate_json, name=display_path(rate_json))
  return model.default_rate(topology_lib.H800_NVLINK)


def print_setting(h800_rate: tuple[float, str], l20_rate: tuple[float, str]) -> None:
  """Both testbeds and the expert GEMM rates they are priced at."""
  print(topology_lib.describe(topology_lib.H800_NVLINK), "\n")
  print(topology_lib.describe(topology_lib.L20_PCIE), "\n")
  print(
    f"expert GEMM rate: H800 {h800_rate[0] / 1e12:.0f} TFLOP/s ({h800_rate[1]}; the H800 has the H100 SXM5's "
    f"compute); L20 {l20_rate[0] / 1e12:.0f} TFLOP/s ({l20_rate[1]}). Smaller GEMMs: "
    f"{overlap.GemmCurve().label} wave model ({overlap.TILE}x{overlap.TILE} tiles, {overlap.HOPPER_SMS} SMs; "
    "the H100 results time 16384 rows only)\n"
  )


def print_schedules(per_m: dict, l20_costs: dict) -> None:
  """Every schedule's times per M on the H800s (`per_m`: M -> `comet_schedules`), then on the L20s."""
  print("8 x H800, EP 8, Mixtral 8x7B layer forward (ms; hidden = share of the schedule's communication under matmuls)")
  print(f"{'M':>6s} {'schedule':14s} {'time':>8s} {'comm':>8s} {'compute':>8s} {'hidden':>7s} {'vs seq':>7s}")
  for m, costs in list(per_m.items()) + [("L20 8192 top-4", l20_costs)]:
    for name, c in costs.items():
      print(
        f"{m!s:>6s} {name:14s} {c.time_s * 1e3:8.3f} {c.communication_s * 1e3:8.3f} {c.compute_s * 1e3:8.3f} "
        f"{c.hidden_fraction:7.1%} {costs['sequential'].time_s / c.time_s:6.2f}x"
      )


def comet_speedup(costs: dict, base: str) -> float:
  """Schedule `base`'s time over the best comet schedule's, in one `comet_schedules` result."""
  return costs[base].time_s / costs["comet_best"].time_s


def comparison_rows(per_m: dict, l20_costs: dict) -> list[tuple]:
  """(quantity, (paper, source), model as text): the hidden shares at the largest M, the H800 speedup ranges over
  M and the L20's speedups."""
  big = per_m[COMET_TOKENS[-1]]
  h800_seq = [comet_speedup(c, "sequential") for c in per_m.values()]
  h800_chunk = [comet_speedup(c, "chunked_best") for c in per_m.values()]
  l20 = f"{comet_speedup(l20_costs, 'sequential'):.2f}x / {comet_speedup(l20_costs, 'chunked_best'):.2f}x"
  return [
    ("communication hidden, comet", COMET_PAPER["hidden_comet"], f"{big['comet_best'].hidden_fraction:.1%}"),
    (
      "communication hidden, Tutel ~ chunked best",
      COMET_PAPER["hidden_tutel"],
      f"{big['chunked_best'].hidden_fraction:.1%}",
    ),
    (
      "communication hidden, FasterMoE ~ chunked C=2",
      COMET_PAPER["hidden_fastermoe"],
      f"{big['chunked_2'].hidden_fraction:.1%}",
    ),
    (
      "layer speedup over sequential, H800",
      COMET_PAPER["layer_speedup_h800"],
      f"{min(h800_seq):.2f}-{max(h800_seq):.2f}x",
    ),
    (
      "layer speedup over best chunked, H800",
      COMET_PAPER["layer_speedup_h800"],
      f"{min(h800_chunk):.2f}-{max(h800_chunk):.2f}x",
    ),
    ("layer speedup over sequential / chunked, L20", COMET_PAPER["layer_speedup_l20"], l20),
  ]


def print_comparison(rows: list[tuple]) -> None:
  """`comparison_rows` as a table: a share or a speedup range from the paper beside the model's."""
  print(f"\n{'quantity (M 16384 for hidden)':48s} {'paper':>12s} {'model':>14s}  source")
  for quantity, (paper, source), value in rows:
    shown = f"{paper[0]:.2f}-{paper[1]:.2f}x" if isinstance(paper, tuple) else f"{paper:.1%}"
    print(f"{quantity:48s} {shown:>12s} {value:>14s}  {source}")


def section(rate_json: str) -> dict:
  """Comet's single-layer setting priced under the three schedules, side by side with its numbers. rate_json: a
  benchmark JSON whose measured TFLOP/s prices the H800's expert GEMMs ('' = datasheet peak x efficiency)."""
  h800_rate = h800_rate_of(rate_json)
  l20_rate = model.default_rate(topology_lib.L20_PCIE)
  print_setting(h800_rate, l20_rate)
  per_m = {m: comet_schedules(topology_lib.H800_NVLINK, m, 2, h800_rate) for m in COMET_TOKENS}
  l20_costs = comet_schedules(topology_lib.L20_PCIE, 8192, 4, l20_rate)
  print_schedules(per_m, l20_costs)
  rows = comparison_rows(per_m, l20_costs)
  print_comparison(rows)
  return dict(
    setting=dict(
      COMET_MIXTRAL,
      tokens=COMET_TOKENS,
      chunks=COMET_CHUNKS,
      routing="uniform",
      dtype="bf16",
      h800_rate=h800_rate,
      l20_rate=l20_rate,
      gemm_curve="modelled",
    ),
    h800={m: {k: v.as_dict() for k, v in c.items()} for m, c in per_m.items()},
    l20={k: v.as_dict() for k, v in l20_costs.items()},
    comparison=[dict(quantity=q, paper=p, source=src, model=v) for q, (p, src), v in rows],
  )


# Comet's baselines (Sec. 5.1) as the model's schedules: the Megatron pair runs no overlap; FasterMoE pipelines with
# a degree of 2 (Related Work); Tutel searches its pipeline degree (here: the best chunked).
BASELINES = {
  "Megatron-Cutlass": "sequential",
  "Megatron-TE": "sequential",
  "FasterMoE": "chunked_2",
  "Tutel": "chunked_best",
}


def baseline_speedups(per_m: dict) -> dict:
  """Each baseline's mean over M of its time over comet's best."""
  return {
    name: float(np.mean([c[schedule].time_s / c["comet_best"].time_s for c in per_m.values()]))
    for name, schedule in BASELINES.items()
  }


# The hidden shares of Fig. 11 as fidelity rows: (COMET_PAPER key, quantity, the schedule standing in for the system).
HIDDEN = (
  ("hidden_comet", "communication hidden, comet (M 16384)", "comet_best"),
  ("hidden_tutel", "communication hidden, Tutel ~ best chunked", "chunked_best"),
  ("hidden_fastermoe", "communication hidden, FasterMoE ~ chunked C=2", "chunked_2"),
)


def hidden_rows(big: dict) -> list[dict]:
  """Fig. 11's hidden shares against the schedules' at the largest M (`big`: a `comet_schedules` result)."""
  return [
    fidelity_row(
      "Comet",
      quantity,
      COMET_PAPER[key][0],
      big[schedule].hidden_fraction,
      "held out",
      COMET_PAPER[key][1],
      "h800_nvlink",
    )
    for key, quantity, schedule in HIDDEN
  ]


def h800_speedup_rows(per_m: dict) -> list[dict]:
  """Fig. 10's speedup range over the baselines against the lowest and highest baseline's mean over M."""
  h800, (lo, hi) = baseline_speedups(per_m), COMET_PAPER["layer_speedup_h800"][0]
  source = COMET_PAPER["layer_speedup_h800"][1]
  note = f"mean over M {COMET_TOKENS} per baseline: " + ", ".join(f"{k} {v:.2f}x" for k, v in h800.items())
  return [
    fidelity_row(
      "Comet",
      "layer speedup over baselines, low end (H800)",
      lo,
      min(h800.values()),
      "held out",
      source,
      "h800_nvlink",
      note=note,
    ),
    fidelity_row(
      "Comet",
      "layer speedup over baselines, high end (H800)",
      hi,
      max(h800.values()),
      "held out",
      source,
      "h800_nvlink",
    ),
  ]


def l20_speedup_rows(l20: dict) -> list[dict]:
  """Fig. 14's speedup range on the L20s against comet's over sequential, chunked C=2 and the best chunked."""
  speedups = [comet_speedup(l20, s) for s in ("sequential", "chunked_2", "chunked_best")]
  (lo, hi), source = COMET_PAPER["layer_speedup_l20"]
  note = (
    "model: EP 8 only, over sequential / chunked C=2 / best chunked; the paper's range runs over EP x TP = 8 strategies"
  )
  return [
    fidelity_row(
      "Comet", "layer speedup, low end (L20, PCIe)", lo, min(speedups), "held out", source, "l20_pcie", note=note
    ),
    fidelity_row("Comet", "layer speedup, high end (L20, PCIe)", hi, max(speedups), "held out", source, "l20_pcie"),
  ]


def fidelity_rows(rate_json: str = str(RATE_JSON)) -> list[dict]:
  """The fidelity table's Comet lines (no parameter is fitted: every line is held out). 'compared with the
  baselines on average' (Sec. 5.3) is read as each baseline's speedup averaged over M, the range running over the
  baselines: the text calls the improvement 'stable' across M."""
  h800_rate = h800_rate_of(rate_json)
  per_m = {m: comet_schedules(topology_lib.H800_NVLINK, m, 2, h800_rate) for m in COMET_TOKENS}
  l20 = comet_schedules(topology_lib.L20_PCIE, 8192, 4, model.default_rate(topology_lib.L20_PCIE))
  return hidden_rows(per_m[COMET_TOKENS[-1]]) + h800_speedup_rows(per_m) + l20_speedup_rows(l20)
