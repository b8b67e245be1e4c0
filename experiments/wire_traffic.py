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

import numpy as np

from moejax import cli
from moejax.models import presets
from moejax.moe import path as path_lib
from moejax.moe import wire as wire_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.study.progress import Progress
from moejax.validation import is_int, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "wire_traffic.py")

# (nodes, GPUs per node) per preset. DeepSeek-V3 trains with 64-way expert parallelism over 8 nodes of 8 H800s
# (its report, Sec. 3.2); Qwen3-MoE publishes no deployment: 128 experts over 2 or 4 nodes of 8 GPUs (8 or 4
# experts per GPU); Mixtral's 8 experts on one 8-GPU node, and over 2 nodes of 4.
MESHES = {"deepseek_v3": ((8, 8),), "qwen3_moe": ((2, 8), (4, 8)), "mixtral_8x7b": ((1, 8), (2, 4))}
QUICK_MESHES = ((2, 4), (4, 2))
QUICK_EXPERTS = {"deepseek_v3": 32, "qwen3_moe": 16}  # the routing scaled down to 8 devices
NODE_LIMIT = 4  # DeepSeek-V3: a token's experts on at most 4 nodes (of 8: half the nodes on smaller meshes)
PATHS = ("flat", "gpu_first", "node_first")
QUICK_PATHS = ("flat", "node_first")
# wire name -> (dispatch_dtype, combine_dtype)
WIRES = {"fp32": (None, None), "bf16": ("bfloat16", "bfloat16"), "fp8": (wire_lib.FP8, "bfloat16")}
RUN_WIRE = {False: "fp32", True: "fp8"}  # the wire each run uses (rows do not depend on it): before and after
ROUTERS = ("uniform", "skewed")
QUICK_ROUTERS = ("uniform",)
ITEMSIZE = 4  # float32 activations
# The skewed router: HOT_FRACTION of the experts (at least one, drawn at random) get BOOST added to their logits,
# through a shared direction u of the tokens: x = z + SHIFT u, w_e = (I - u u^T) w_e' + [e hot] BOOST / SHIFT u.
HOT_FRACTION, BOOST, SHIFT = 1 / 32, 1.5, 4.0


def hop_name(hop) -> str:
  return "flat" if not isinstance(hop, str) else hop


def layer_config(
  preset: str, nodes: int, gpus: int, d_sim: int, path: str, dedup: bool, wire: str, experts: int | None = None
) -> MoEConfig:
  """The preset's routing at width d_sim on a nodes x gpus mesh (`experts`: fewer routed experts, for quick).
  DeepSeek-V3's group limit becomes node-limited routing over the mesh's nodes (its groups are its 8 nodes)."""
  fields = presets.moe_fields(preset)
  num_experts = experts or fields["num_experts"]
  routing = {}
  if fields.pop("num_groups", None) is not None:
    fields.pop("topk_groups")
    routing = dict(routing="node_limited", num_nodes=nodes, node_top_k=min(NODE_LIMIT, max(1, nodes // 2)))
  dispatch, combine = WIRES[wire]
  return MoEConfig(
    **{
      **fields,
      **routing,
      "num_experts": num_experts,
      "d_model": d_sim,
      "d_ff": 32,
      "shared_d_ff": 32 if fields.get("num_shared_experts") else None,
      "balance_loss": "batch",
      "path": path,
      "dedup": dedup,
      "dispatch_dtype": dispatch,
      "combine_dtype": combine,
    }
  )


def router_inputs(cfg: MoEConfig, router: str, tokens: int, seed: int):
  """(router kernel [d, E], x [tokens, d]) as NumPy: 'uniform' routes x ~ N(0, I) to every expert equally often
  (`moejax.study.inputs.balanced_routers`); 'skewed' makes a few experts hot (HOT_FRACTION, BOOST, SHIFT)."""
  from moejax.study import inputs

  rng = np.random.default_rng(seed)
  kernel = np.asarray(inputs.balanced_routers(cfg, seed)["router"]["kernel"], np.float32)
  x = rng.standard_normal((tokens, cfg.d_model)).astype(np.float32)
  if router == "skewed":
    u = rng.standard_normal(cfg.d_model)
    u /= np.linalg.norm(u)
    hot = rng.choice(cfg.num_experts, max(1, round(cfg.num_experts * HOT_FRACTION)), replace=False)
    kernel = kernel - np.outer(u, u @ kernel)
    kernel[:, hot] += BOOST / SHIFT * u[:, None]
    x = x + SHIFT * u.astype(np.float32)
  return kernel.astype(np.float32), x


def bound_rows(
  ids_TxK: np.ndarray, num_experts: int, devices: int, gpus_per_node: int, hops, dedup: bool = True
) -> np.ndarray:
  """[hops, A, A] rows each hop must move from flat device s to p, from the routing alone: token t starts on
  device t // (T / A), expert e lives on device e // (E / A); a hop over 'node' ('gpu') replaces the node (GPU
  index) of where a choice is with its expert's. dedup: one row per (token, device it is at, destination);
  else one per choice. ids_TxK: [T, K] global expert ids."""
  tokens, k = ids_TxK.shape
  m = gpus_per_node
  dest_TxK = ids_TxK // (num_experts // devices)
  at_TxK = np.broadcast_to((np.arange(tokens) // (tokens // devices))[:, None], (tokens, k))
  token_TxK = np.broadcast_to(np.arange(tokens)[:, None], (tokens, k))
  out = []
  for hop in hops:
    axes = mesh_lib.hop_axes(hop)
    node = np.where(mesh_lib.NODE in axes, dest_TxK // m, at_TxK // m)
    gpu = np.where(mesh_lib.GPU in axes, dest_TxK % m, at_TxK % m)
    to_TxK = node * m + gpu
    moves = np.stack([token_TxK.ravel(), at_TxK.ravel(), to_TxK.ravel()], axis=1)
    if dedup:
      moves = np.unique(moves, axis=0)
    traffic = np.zeros((devices, devices), np.int64)
    np.add.at(traffic, (moves[:, 1], moves[:, 2]), 1)
    out.append(traffic)
    at_TxK = to_TxK
  return np.stack(out)


def deepep_rows(ids_TxK: np.ndarray, num_experts: int, devices: int, gpus_per_node: int) -> int:
  """Rows DeepEP sends over RDMA: each token once per node of its experts other than its own."""
  tokens = ids_TxK.shape[0]
  node_TxK = ids_TxK // (num_experts // devices) // gpus_per_node
  own_T = np.arange(tokens) // (tokens // devices) // gpus_per_node
  return sum(len(set(nodes) - {own}) for nodes, own in zip(node_TxK.tolist(), own_T.tolist()))


def row_bytes(wire: str, d: int, slots: int) -> dict:
  """Bytes of one row on the wire (as `moejax.moe.traffic.traffic_bytes` counts them with no receive bound):
  out: the payload in the dispatch dtype (FP8's scales included) and each slot's int32 id and float32 weight;
  back: the result in the combine dtype."""
  row = wire_lib.row_bytes(d, slots, ITEMSIZE, *WIRES[wire])
  return {"out": row.dispatch, "back": row.combine}


def deepep_payload_bytes(d: int) -> dict:
  """DeepEP's volume per row: FP8 e4m3 with a float32 scale per 128 elements out, BF16 back."""
  return {"out": d + 4 * -(-d // 128), "back": 2 * d}


def deepep_message_bytes(d: int, top_k: int) -> dict:
  """DeepEP's RDMA message per token as its internode kernels size it (csrc/kernels/internode.cu,
  `get_num_bytes_per_token`: hidden bytes + SourceMeta (two int32) + float32 scales + int32 top-k ids + float32
  top-k weights, rounded up to 16 bytes); the combine sends the BF16 hidden, SourceMeta and top-k weights."""

  def align16(b):
    return -(-b // 16) * 16

  return {"out": align16(d + 8 + 4 * -(-d // 128) + 8 * top_k), "back": align16(2 * d + 8 + 4 * top_k)}


def split(traffic_AxA: np.ndarray, gpus_per_node: int) -> tuple[int, int]:
  """(inter-node, intra-node) rows of an [A, A] matrix, the diagonal left out."""
  cross, inside = mesh_lib.pair_masks(traffic_AxA.shape[0], gpus_per_node)
  return int(traffic_AxA[cross].sum()), int(traffic_AxA[inside].sum())


def measure(
  preset: str,
  nodes: int,
  gpus: int,
  router: str,
  paths,
  d_sim: int,
  tokens_per_device: int,
  experts: int | None,
  seed: int = 0,
) -> dict:
  """One preset on one mesh with one router: each path with dedup off and on, rows against the bound."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moejax.moe.layer import moe_apply
  from moejax.study import inputs

  mesh = mesh_lib.make_mesh(nodes, gpus)
  devices, tokens = nodes * gpus, nodes * gpus * tokens_per_device
  published = presets.PRESETS[preset].moe["d_model"]
  base = layer_config(preset, nodes, gpus, d_sim, "flat", True, "fp32", experts)
  kernel, x_TxD = router_inputs(base, router, tokens, seed)
  x = jax.device_put(x_TxD, NamedSharding(mesh, P(mesh_lib.AXES)))
  case = {
    "preset": preset,
    "mesh": [nodes, gpus],
    "router": router,
    "tokens": tokens,
    "published_d": published,
    "num_experts": base.num_experts,
    "top_k": base.top_k,
    "routing": base.routing,
    "node_top_k": base.node_top_k if base.router.chooses_nodes else None,
    "runs": [],
  }
  ids = None
  for path in paths:
    for dedup in (False, True):
      wire = RUN_WIRE[dedup]
      cfg = layer_config(preset, nodes, gpus, d_sim, path, dedup, wire, experts)
      params = inputs.layer_params(cfg, mesh, seed, jax.numpy.float32, balanced_router=False)
      params["router"]["kernel"] = jax.device_put(kernel, params["router"]["kernel"].sharding)
      _, aux = moe_apply(params, x, cfg, mesh)
      rows = np.asarray(aux["traffic_rows"], np.int64)
      run_ids = np.asarray(aux["expert_ids"])
      assert ids is None or (run_ids == ids).all(), "the routing changed between runs"
      ids = run_ids
      assert int(aux["tokens_overflowed"]) == 0 and int(aux["tokens_dropped"]) == 0
      slots = cfg.choices_per_token if dedup else 1
      sim = row_bytes(wire, d_sim, slots)
      expect = rows * sim["out"] + np.swapaxes(rows, -1, -2) * sim["back"]
      assert np.allclose(np.asarray(aux["traffic_bytes"]), expect, rtol=1e-6, atol=0), "byte accounting differs"
      hops = path_lib.hops(path)
      bound = bound_rows(ids, cfg.num_experts, devices, gpus, hops, dedup=True)
      per_choice = bound_rows(ids, cfg.num_experts, devices, gpus, hops, dedup=False)
      wires = {w: row_bytes(w, published, slots) for w in WIRES}
      run = {"path": path, "dedup": dedup, "slots_per_row": slots, "run_wire": wire, "row_bytes": wires, "hops": []}
      for h, hop in enumerate(hops):
        inter, intra = split(rows[h], gpus)
        b_inter, b_intra = split(bound[h], gpus)
        run["hops"].append(
          {
            "hop": hop_name(hop),
            "inter_rows_per_token": inter / tokens,
            "intra_rows_per_token": intra / tokens,
            "bound_inter_rows_per_token": b_inter / tokens,
            "bound_intra_rows_per_token": b_intra / tokens,
            "rows": inter + intra,
            "bound_rows": b_inter + b_intra,
            "ratio": (inter + intra) / (b_inter + b_intra)
            if b_inter + b_intra
            else 1.0
            if inter + intra == 0
            else float("inf"),
            "equals_bound": bool(np.array_equal(rows[h], bound[h])),
            "equals_per_choice": bool(np.array_equal(rows[h], per_choice[h])),
            "bytes_per_token": {
              w: {"inter": inter * (b["out"] + b["back"]) / tokens, "intra": intra * (b["out"] + b["back"]) / tokens}
              for w, b in wires.items()
            },
          }
        )
      run["bytes_per_token"] = {
        w: {side: sum(hop["bytes_per_token"][w][side] for hop in run["hops"]) for side in ("inter", "intra")}
        for w in WIRES
      }
      case["runs"].append(run)
      print(
        f"  {preset} {nodes}x{gpus} {router} {path} dedup={dedup}: "
        + ", ".join(f"{hop['hop']} {hop['rows']}/{hop['bound_rows']}" for hop in run["hops"]),
        flush=True,
      )
  loads = np.bincount(ids.reshape(-1), minlength=case["num_experts"]).astype(float)
  device_loads = loads.reshape(devices, -1).sum(1)
  case["skew"] = {
    "busiest_expert_over_mean": loads.max() / loads.mean(),
    "busiest_device_over_mean": device_loads.max() / device_loads.mean(),
    "busiest_node_over_mean": (lambda n: n.max() / n.mean())(device_loads.reshape(nodes, -1).sum(1)),
  }
  payload, message = deepep_payload_bytes(published), deepep_message_bytes(published, base.top_k)
  deepep = deepep_rows(ids, case["num_experts"], devices, gpus)
  case["deepep"] = {
    "inter_rows_per_token": deepep / tokens,
    "payload_row_bytes": payload,
    "message_row_bytes": message,
    "payload_bytes_per_token": deepep * (payload["out"] + payload["back"]) / tokens,
    "message_bytes_per_token": deepep * (message["out"] + message["back"]) / tokens,
  }
  return case


def summary(case: dict) -> dict:
  """Inter-node bytes per token: before (dedup off, fp32) on the flat and node_first paths, after (node_first,
  dedup, fp8 out / bf16 back; also its payload alone, without the slots' ids and weights) and DeepEP's."""
  runs = {(r["path"], r["dedup"]): r for r in case["runs"]}
  after = runs[("node_first", True)]
  node_hop = after["hops"][0]
  payload = node_hop["inter_rows_per_token"] * sum(deepep_payload_bytes(case["published_d"]).values())
  deepep = case["deepep"]
  return {
    "preset": case["preset"],
    "mesh": "x".join(map(str, case["mesh"])),
    "router": case["router"],
    "flat_before": runs[("flat", False)]["bytes_per_token"]["fp32"]["inter"],
    "node_first_before": runs[("node_first", False)]["bytes_per_token"]["fp32"]["inter"],
    "after": after["bytes_per_token"]["fp8"]["inter"],
    "after_payload": payload,
    "deepep_payload": deepep["payload_bytes_per_token"],
    "deepep_message": deepep["message_bytes_per_token"],
    "after_rows": node_hop["inter_rows_per_token"],
    "deepep_rows": deepep["inter_rows_per_token"],
    "at_or_below_deepep": after["bytes_per_token"]["fp8"]["inter"] <= deepep["message_bytes_per_token"] + 1e-9
    and payload <= deepep["payload_bytes_per_token"] + 1e-9,
  }


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
    record["cases"].append(
      measure(
        preset,
        nodes,
        gpus,
        router,
        QUICK_PATHS if quick else PATHS,
        d_sim,
        tokens_per_device,
        QUICK_EXPERTS[preset] if quick else None,
        seed,
      )
    )
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
