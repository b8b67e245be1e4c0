"""The published MoE layers' wire traffic measured (experiments/wire_traffic.py): a preset's routing at a small
width on a simulated mesh (`layer_config`), with a uniform or a skewed router (`router_inputs`), each path with dedup
off and on: the rows each hop moved (`aux['traffic_rows']`, checked against the layer's byte accounting) against the
rows it must move (`moejax.study.wire_bounds`), bytes per token per wire at the published width, and DeepEP's volume.
"""

import numpy as np

from moejax.models import presets
from moejax.moe import path as path_lib
from moejax.moe.config import MoEConfig
from moejax.runtime import mesh as mesh_lib
from moejax.study.wire_bounds import (
  WIRES,
  bound_rows,
  deepep_message_bytes,
  deepep_payload_bytes,
  deepep_rows,
  row_bytes,
  split,
)

NODE_LIMIT = 4  # DeepSeek-V3: a token's experts on at most 4 nodes (of 8: half the nodes on smaller meshes)
RUN_WIRE = {False: "fp32", True: "fp8"}  # the wire each run uses (rows do not depend on it): before and after
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


def hop_entry(rows_AxA, bound_AxA, per_choice_AxA, hop, gpus: int, tokens: int, wires: dict) -> dict:
  """One hop of a run: its inter- and intra-node rows per token against the bound, and bytes per token per wire
  (wires: wire -> `row_bytes` at the published width)."""
  inter, intra = split(rows_AxA, gpus)
  b_inter, b_intra = split(bound_AxA, gpus)
  moved, needed = inter + intra, b_inter + b_intra
  return {
    "hop": hop_name(hop),
    "inter_rows_per_token": inter / tokens,
    "intra_rows_per_token": intra / tokens,
    "bound_inter_rows_per_token": b_inter / tokens,
    "bound_intra_rows_per_token": b_intra / tokens,
    "rows": moved,
    "bound_rows": needed,
    "ratio": moved / needed if needed else 1.0 if moved == 0 else float("inf"),
    "equals_bound": bool(np.array_equal(rows_AxA, bound_AxA)),
    "equals_per_choice": bool(np.array_equal(rows_AxA, per_choice_AxA)),
    "bytes_per_token": {
      w: {"inter": inter * (b["out"] + b["back"]) / tokens, "intra": intra * (b["out"] + b["back"]) / tokens}
      for w, b in wires.items()
    },
  }


def measure_run(case: dict, mesh, path: str, dedup: bool, kernel, x, experts: int | None, seed: int):
  """(the run's record, its expert ids [T, K]): the layer on one path with dedup off or on, its rows checked against
  its byte accounting and compared with the bound."""
  import jax

  from moejax.moe.layer import moe_apply
  from moejax.study import inputs

  preset, (nodes, gpus), tokens = case["preset"], case["mesh"], case["tokens"]
  wire = RUN_WIRE[dedup]
  cfg = layer_config(preset, nodes, gpus, case["d_sim"], path, dedup, wire, experts)
  params = inputs.layer_params(cfg, mesh, seed, jax.numpy.float32, balanced_router=False)
  params["router"]["kernel"] = jax.device_put(kernel, params["router"]["kernel"].sharding)
  _, aux = moe_apply(params, x, cfg, mesh)
  rows = np.asarray(aux["traffic_rows"], np.int64)
  ids = np.asarray(aux["expert_ids"])
  assert int(aux["tokens_overflowed"]) == 0 and int(aux["tokens_dropped"]) == 0
  slots = cfg.choices_per_token if dedup else 1
  sim = row_bytes(wire, case["d_sim"], slots)
  expect = rows * sim["out"] + np.swapaxes(rows, -1, -2) * sim["back"]
  assert np.allclose(np.asarray(aux["traffic_bytes"]), expect, rtol=1e-6, atol=0), "byte accounting differs"
  hops = path_lib.hops(path)
  bound = bound_rows(ids, cfg.num_experts, nodes * gpus, gpus, hops, dedup=True)
  per_choice = bound_rows(ids, cfg.num_experts, nodes * gpus, gpus, hops, dedup=False)
  wires = {w: row_bytes(w, case["published_d"], slots) for w in WIRES}
  run = {"path": path, "dedup": dedup, "slots_per_row": slots, "run_wire": wire, "row_bytes": wires}
  run["hops"] = [hop_entry(rows[h], bound[h], per_choice[h], hop, gpus, tokens, wires) for h, hop in enumerate(hops)]
  run["bytes_per_token"] = {
    w: {side: sum(hop["bytes_per_token"][w][side] for hop in run["hops"]) for side in ("inter", "intra")} for w in WIRES
  }
  return run, ids


def loads_and_deepep(case: dict, ids_TxK: np.ndarray) -> dict:
  """How uneven the routing's load is (busiest expert, device and node over the mean) and DeepEP's volume for it."""
  nodes, gpus = case["mesh"]
  loads = np.bincount(ids_TxK.reshape(-1), minlength=case["num_experts"]).astype(float)
  device_loads = loads.reshape(nodes * gpus, -1).sum(1)
  node_loads = device_loads.reshape(nodes, -1).sum(1)
  published, tokens = case["published_d"], case["tokens"]
  payload, message = deepep_payload_bytes(published), deepep_message_bytes(published, case["top_k"])
  deepep = deepep_rows(ids_TxK, case["num_experts"], nodes * gpus, gpus)
  return {
    "skew": {
      "busiest_expert_over_mean": loads.max() / loads.mean(),
      "busiest_device_over_mean": device_loads.max() / device_loads.mean(),
      "busiest_node_over_mean": node_loads.max() / node_loads.mean(),
    },
    "deepep": {
      "inter_rows_per_token": deepep / tokens,
      "payload_row_bytes": payload,
      "message_row_bytes": message,
      "payload_bytes_per_token": deepep * (payload["out"] + payload["back"]) / tokens,
      "message_bytes_per_token": deepep * (message["out"] + message["back"]) / tokens,
    },
  }


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

  mesh = mesh_lib.make_mesh(nodes, gpus)
  tokens = nodes * gpus * tokens_per_device
  base = layer_config(preset, nodes, gpus, d_sim, "flat", True, "fp32", experts)
  kernel, x_TxD = router_inputs(base, router, tokens, seed)
  x = jax.device_put(x_TxD, NamedSharding(mesh, P(mesh_lib.AXES)))
  case = {
    "preset": preset,
    "mesh": [nodes, gpus],
    "router": router,
    "tokens": tokens,
    "published_d": presets.PRESETS[preset].moe["d_model"],
    "num_experts": base.num_experts,
    "top_k": base.top_k,
    "routing": base.routing,
    "node_top_k": base.node_top_k if base.router.chooses_nodes else None,
    "runs": [],
  }
  ids = None
  for path in paths:
    for dedup in (False, True):
      run, run_ids = measure_run({**case, "d_sim": d_sim}, mesh, path, dedup, kernel, x, experts, seed)
      assert ids is None or (run_ids == ids).all(), "the routing changed between runs"
      ids = run_ids
      case["runs"].append(run)
  return {**case, **loads_and_deepep(case, ids)}


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
