"""Wire traffic of the published MoE layers: rows and bytes per token per exchange hop, against the rows each hop
must move and against DeepEP's volume.

  python -m experiments.wire_traffic --workdir=/tmp/wire           # the presets' meshes, 64 devices (~3 min)
  python -m experiments.wire_traffic --config.quick=True           # 2 x 4 and 4 x 2, scaled-down experts (~25 s)

For the routing of the DeepSeek-V3 (node-limited: 256 experts, top-8 within 4 of 8 nodes), Qwen3-MoE-30B-A3B
(128 experts, top-8) and Mixtral-8x7B (8 experts, top-2) presets (`moejax.models.presets`), each on simulated CPU
meshes of the nodes x GPUs per node they are deployed on (`MESHES`), the real layer (`moe_apply`) runs with
d_model config.d_sim (64: routing and rows do not depend on the width) for every path ('flat',
'gpu_first', 'node_first') with dedup off and on, for two routers (`ROUTERS`). Its `aux['traffic_rows']` gives
the rows each hop moved; bytes at the published d_model are those rows times the bytes of one row on the wire
(`row_bytes`, from `moejax.moe.wire.payload_bytes`; checked against the run's own `aux['traffic_bytes']` at d_sim),
for three wires: fp32 (the activations' dtype both ways), bf16 (both ways) and fp8 (e4m3 with a float32 scale per
128 elements out, bf16 back). Per hop, against:
  - the bound: the rows the hop must move, counted in NumPy from the routing alone (`aux['expert_ids']`, expert e
    on flat device e // (E / devices)): one row per (token, device it is at, destination of the hop);
  - DeepEP (deepseek-ai/DeepEP, internode kernels): each token once per destination node other than its own over
    RDMA, FP8 out (d + 4 d / 128 bytes) and BF16 back (2 d bytes); also its per-token message as its source sizes it
    (`deepep_message_bytes`).
Inter-node traffic is what crosses nodes, intra-node what stays in one; a device's rows to itself are left out.
configs/wire_traffic.py holds the options; with --workdir the record goes to <workdir>/wire_traffic.json.
"""

import os
import time

from moejax import cli
from moejax.runtime import mesh as mesh_lib
from moejax.study.progress import Progress
from moejax.study.wire_bounds import WIRES
from moejax.study.wire_traffic import BOOST, HOT_FRACTION, RUN_WIRE, SHIFT, measure, summary
from moejax.validation import is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "wire_traffic.py")

# (nodes, GPUs per node) per preset. DeepSeek-V3 trains with 64-way expert parallelism over 8 nodes of 8 H800s
# (its report, Sec. 3.2); Qwen3-MoE publishes no deployment: 128 experts over 2 or 4 nodes of 8 GPUs (8 or 4
# experts per GPU); Mixtral's 8 experts on one 8-GPU node, and over 2 nodes of 4.
MESHES = {"deepseek_v3": ((8, 8),), "qwen3_moe": ((2, 8), (4, 8)), "mixtral_8x7b": ((1, 8), (2, 4))}
QUICK_MESHES = ((2, 4), (4, 2))
QUICK_EXPERTS = {"deepseek_v3": 32, "qwen3_moe": 16}  # the routing scaled down to 8 devices
PATHS = ("flat", "gpu_first", "node_first")
QUICK_PATHS = ("flat", "node_first")
ROUTERS = ("uniform", "skewed")
QUICK_ROUTERS = ("uniform",)


def run(quick: bool = False, d_sim: int = 64, tokens_per_device: int | None = None, seed: int = 0) -> dict:
  """The record: every case (`measure`) and the summary; the devices must exist (`simulate_cpu_devices`)."""
  import jax

  tokens_per_device = tokens_per_device or (16 if quick else 128)
  meshes = {p: QUICK_MESHES for p in QUICK_EXPERTS} if quick else MESHES
  record = {
    "date": time.strftime("%Y-%m-%d"),
    "jax": jax.__version__,
    "device": jax.devices()[0].device_kind,
    "quick": quick,
    "d_sim": d_sim,
    "tokens_per_device": tokens_per_device,
    "seed": seed,
    "wires": {w: list(v) for w, v in WIRES.items()},
    "run_wire": {str(k): v for k, v in RUN_WIRE.items()},
    "skewed_router": {"hot_fraction": HOT_FRACTION, "boost": BOOST, "shift": SHIFT},
    "cases": [],
  }
  routers = QUICK_ROUTERS if quick else ROUTERS
  cases = [
    (preset, nodes, gpus, router) for preset, shapes in meshes.items() for nodes, gpus in shapes for router in routers
  ]
  progress = Progress(len(cases))
  for preset, nodes, gpus, router in cases:
    paths, experts = (QUICK_PATHS, QUICK_EXPERTS[preset]) if quick else (PATHS, None)
    case = measure(preset, nodes, gpus, router, paths, d_sim, tokens_per_device, experts, seed)
    for r in case["runs"]:
      hops = ", ".join(f"{hop['hop']} {hop['rows']}/{hop['bound_rows']}" for hop in r["hops"])
      print(f"  {preset} {nodes}x{gpus} {router} {r['path']} dedup={r['dedup']}: {hops}", flush=True)
    record["cases"].append(case)
    print(progress.step(f"cases: {preset} {nodes}x{gpus} {router}"), flush=True)
  record["summary"] = [summary(case) for case in record["cases"]]
  return record


def table(record: dict) -> str:
  """Fixed-width tables: per hop (rows per token against the bound, kB per token per wire), then the summary."""
  head = (
    f"{'preset':13s} {'mesh':4s} {'router':7s} {'path':12s} {'dedup':5s} {'hop':4s} "
    f"{'inter rows/tok':>14s} {'(bound)':>7s} {'intra rows/tok':>14s} {'(bound)':>7s} {'ratio':>5s}  "
    f"{'inter kB/tok fp32':>17s} {'bf16':>7s} {'fp8':>7s}  {'intra kB/tok fp32':>17s} {'bf16':>7s} {'fp8':>7s}"
  )
  lines = [head]
  for case in record["cases"]:
    mesh = "x".join(map(str, case["mesh"]))
    for r in case["runs"]:
      for hop in r["hops"]:
        kb = {side: [hop["bytes_per_token"][w][side] / 1e3 for w in WIRES] for side in ("inter", "intra")}
        lines.append(
          f"{case['preset']:13s} {mesh:4s} {case['router']:7s} {r['path']:12s} "
          f"{'on' if r['dedup'] else 'off':5s} "
          f"{hop['hop']:4s} {hop['inter_rows_per_token']:14.3f} {hop['bound_inter_rows_per_token']:7.3f} "
          f"{hop['intra_rows_per_token']:14.3f} {hop['bound_intra_rows_per_token']:7.3f} {hop['ratio']:5.2f}  "
          f"{kb['inter'][0]:17.2f} {kb['inter'][1]:7.2f} {kb['inter'][2]:7.2f}  "
          f"{kb['intra'][0]:17.2f} {kb['intra'][1]:7.2f} {kb['intra'][2]:7.2f}"
        )
    lines.append(
      f"{'':13s} {mesh:4s} {case['router']:7s} {'DeepEP':12s} {'':5s} {'rdma':4s} "
      f"{case['deepep']['inter_rows_per_token']:14.3f} {'':7s} {'':14s} {'':7s} {'':5s}  "
      f"{'':17s} {'':7s} {case['deepep']['payload_bytes_per_token'] / 1e3:7.2f}"
    )
  lines += [
    "",
    "inter-node kB per token: before = dedup off, fp32; after = node_first, dedup, fp8 out / bf16 back "
    "(payload: without the slots' ids and weights); DeepEP = once per other node, fp8 out / bf16 back "
    "(payload; message: as its kernels size it)",
    f"{'preset':13s} {'mesh':4s} {'router':7s} {'flat before':>11s} {'node_first before':>17s} {'after':>7s} "
    f"{'payload':>7s} {'DeepEP payload':>14s} {'message':>7s} {'rows/tok':>8s} {'DeepEP':>6s} {'at/below':>8s}",
  ]
  for s in record["summary"]:
    lines.append(
      f"{s['preset']:13s} {s['mesh']:4s} {s['router']:7s} {s['flat_before'] / 1e3:11.2f} "
      f"{s['node_first_before'] / 1e3:17.2f} {s['after'] / 1e3:7.2f} {s['after_payload'] / 1e3:7.2f} "
      f"{s['deepep_payload'] / 1e3:14.2f} {s['deepep_message'] / 1e3:7.2f} {s['after_rows']:8.3f} "
      f"{s['deepep_rows']:6.3f} {'yes' if s['at_or_below_deepep'] else 'NO':>8s}"
    )
  return "\n".join(lines)


def markdown_summary(record: dict) -> str:
  """docs/wire.md's summary: inter-node kB per token before, after and DeepEP's, per preset, mesh and router."""
  lines = [
    "| preset | mesh | router | flat, per choice, fp32 | node_first, per choice, fp32 | node_first, dedup, fp8/bf16 "
    "| its payload | DeepEP payload | DeepEP message | rows/token (DeepEP) | at or below |",
    "|---|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
  ]
  for s in record["summary"]:
    lines.append(
      f"| {s['preset']} | {s['mesh']} | {s['router']} | {s['flat_before'] / 1e3:.2f} | "
      f"{s['node_first_before'] / 1e3:.2f} | {s['after'] / 1e3:.2f} | {s['after_payload'] / 1e3:.2f} | "
      f"{s['deepep_payload'] / 1e3:.2f} | {s['deepep_message'] / 1e3:.2f} | {s['after_rows']:.3f} "
      f"({s['deepep_rows']:.3f}) | {'yes' if s['at_or_below_deepep'] else 'no'} |"
    )
  return "\n".join(lines)


def markdown_hops(record: dict, router: str = "uniform") -> str:
  """docs/wire.md's per-hop table for one router: rows per token against the bound, kB per token per wire."""
  lines = [
    "| preset | mesh | path | dedup | hop | inter rows/token (bound) | intra rows/token (bound) | ratio "
    "| inter kB/token fp32 / bf16 / fp8 | intra kB/token fp32 / bf16 / fp8 |",
    "|---|---|---|---|---|--:|--:|--:|--:|--:|",
  ]
  for case in record["cases"]:
    if case["router"] != router:
      continue
    mesh = "x".join(map(str, case["mesh"]))
    for r in case["runs"]:
      for hop in r["hops"]:
        kb = {
          side: " / ".join(f"{hop['bytes_per_token'][w][side] / 1e3:.2f}" for w in WIRES) for side in ("inter", "intra")
        }
        lines.append(
          f"| {case['preset']} | {mesh} | {r['path']} | {'on' if r['dedup'] else 'off'} | "
          f"{hop['hop']} | {hop['inter_rows_per_token']:.3f} ({hop['bound_inter_rows_per_token']:.3f}) | "
          f"{hop['intra_rows_per_token']:.3f} ({hop['bound_intra_rows_per_token']:.3f}) | "
          f"{hop['ratio']:.2f} | {kb['inter']} | {kb['intra']} |"
        )
  return "\n".join(lines)


def markdown_skew(record: dict) -> str:
  """docs/wire.md's table of how uneven each router's load is (busiest over mean)."""
  lines = ["| preset | mesh | router | busiest expert | busiest device | busiest node |", "|---|---|---|--:|--:|--:|"]
  for case in record["cases"]:
    skew = case["skew"]
    lines.append(
      f"| {case['preset']} | {'x'.join(map(str, case['mesh']))} | {case['router']} | "
      f"{skew['busiest_expert_over_mean']:.2f} | {skew['busiest_device_over_mean']:.2f} | "
      f"{skew['busiest_node_over_mean']:.2f} |"
    )
  return "\n".join(lines)


def check(config) -> None:
  """Every field before a device is made; errors name the field."""
  require(isinstance(config.quick, bool), "quick", config.quick, "True or False")
  require(is_int(config.d_sim), "d_sim", config.d_sim, "a positive int")
  require(
    is_int(config.tokens_per_device, 0),
    "tokens_per_device",
    config.tokens_per_device,
    "an int >= 0 (0: 128, or 16 with quick)",
  )


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  shapes = QUICK_MESHES if config.quick else [shape for shapes in MESHES.values() for shape in shapes]
  mesh_lib.simulate_cpu_devices(max(n * m for n, m in shapes))
  start = time.time()
  record = run(config.quick, config.d_sim, config.tokens_per_device or None)
  record["seconds"] = time.time() - start
  print(table(record), flush=True)
  if workdir:
    cli.write_json(workdir, "wire_traffic.json", record)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/wire_traffic.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for wire_traffic.json (optional: without it, the tables only).", required=False
  )
  cli.run(main)
