"""Routing and exchange schemes by name: the one table of the MoEConfig fields each sets, which the scaling sweep
(`moejax.study.points`), the family remedies study (experiments/family_remedies.py) and the routers' convergence
study (configs/convergence.py) derive from.

A scheme is a name of SCHEMES, or several joined by '+' (a router, an exchange and what runs on it, e.g.
'smile+bilevel', 'bilevel+fp8'): their fields merged, later names over earlier ones. Dedup variants: a scheme's
name alone leaves MoEConfig.dedup at its default (None: a row per token and destination of each hop, S2 excepted);
'<scheme>_nodedup' is the same scheme with dedup=False (a row per token-choice on every hop).

The exchanges are named by their path (`moejax.moe.path`), their collective 'auto' (ragged where XLA has a ragged
all-to-all, else padded; resolved where the mesh is known), or by their collective ('ragged', 'capacity'). What
depends on the mesh is a placeholder that `fields` fills in: NODES, its node count. SPARE (replicas: one slot more
than the experts a holder keeps) is left to the caller, which knows the experts.
"""

NODEDUP = "_nodedup"
NODES = "<mesh nodes>"
SPARE = "spare"
FP8 = "float8_e4m3fn"

SCHEMES = {
  # Routers: how a token chooses its experts.
  "switch": dict(routing="topk", top_k=1),  # Switch Transformer: top-1 softmax
  "gshard": dict(routing="topk", top_k=2),  # GShard: top-2 softmax
  "smile": dict(routing="bilevel", num_nodes=NODES, node_top_k=1),  # SMILE: one node, then its experts
  "node_limited": dict(routing="node_limited", num_nodes=NODES),  # DeepSeek-V3's: experts on few nodes only
  # DeepSeek-V3's affinities: sigmoids normalised over the chosen experts, times its 2.5.
  "deepseek_v3": dict(routing="topk", score="sigmoid", routed_scaling=2.5, renormalize=True),
  # Exchanges: how the rows reach the experts' devices.
  "flat": dict(path="flat", collective="auto"),  # one hop over every device
  "ragged": dict(path="flat", collective="ragged"),
  "gpu_first": dict(path="gpu_first", collective="auto"),  # over 'gpu' to the node's peer, then over 'node'
  "node_first": dict(path="node_first", collective="auto"),  # over 'node' to the expert's node, then over 'gpu'
  # GShard's dense dispatch: a block per peer, capacity_factor bounding the rows per expert
  "capacity": dict(path="flat", collective="capacity"),
  # What runs on an exchange: overlap schedules (Comet), expert sharding (Parm), the wire, replicas (Lina, EPLB),
  # expert data parallelism.
  "chunked": dict(schedule="chunked"),
  "comet": dict(schedule="comet"),
  "esp_baseline": dict(esp_schedule="baseline"),
  "s1": dict(esp_schedule="s1"),
  "s2": dict(esp_schedule="s2"),
  "fp8": dict(dispatch_dtype=FP8),  # e4m3 with a float32 scale per 128 elements out; the combine's default back
  "fp8_bf16": dict(dispatch_dtype=FP8, combine_dtype="bfloat16"),
  "replicas": dict(slots_per_device=SPARE),
  "expert_data_parallel": dict(expert_data_parallel=True),
}


def names(scheme: str) -> list[str]:
  """The SCHEMES names a scheme joins ('_nodedup' taken off); ValueError naming an unknown one."""
  parts = scheme.removesuffix(NODEDUP).split("+")
  unknown = [p for p in parts if p not in SCHEMES]
  if unknown:
    raise ValueError(
      f"unknown scheme {unknown[0]!r} in {scheme!r}; schemes join names of {sorted(SCHEMES)} "
      f"with '+', optionally ending in {NODEDUP!r}"
    )
  return parts


def fields(scheme: str, nodes: int) -> dict:
  """The MoEConfig fields `scheme` sets on a mesh of `nodes` nodes."""
  out = {}
  for name in names(scheme):
    out.update(SCHEMES[name])
  out = {k: nodes if v == NODES else v for k, v in out.items()}
  if scheme.endswith(NODEDUP):
    out["dedup"] = False
  return out
