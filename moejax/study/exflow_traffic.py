"""ExFlow's exchange traffic measured by decoding (experiments/exflow_traffic.py): vanilla expert parallelism,
context coherence, and context coherence with the affinity placement, on one mesh at a time.

The embedded corpus's documents are split by kind: standard-library docstrings (even ones: the profiling set the
placement is solved on; odd ones: the prompts measured) and the Python documentation topics (out of distribution,
ExFlow Table III's check). Per mesh the placement is `moejax.placement.solve` on the profiling traces, and each
mode decodes the same requests; the exchange rows per generated token are counted from the exchanges themselves.
Also counted: the transitions of teacher-forced traces under the contiguous and the solved placement.
"""

import json

import numpy as np

from moejax.cost import decode as decode_cost
from moejax.infer import decode
from moejax.placement import affinity, solve
from moejax.placement.traces import routing_traces
from moejax.runtime import mesh as mesh_lib
from moejax.validation import require

DISTRIBUTIONS = {"in": "python-stdlib:", "ood": "python-docs:"}  # url prefixes of the embedded corpus
KINDS = ("profile", "in", "ood")
# (name, decode mode, with the placement, prompts)
RUNS = (
  ("vanilla", "vanilla", False, "in"),
  ("exflow", "exflow", False, "in"),
  ("exflow+placement", "exflow", True, "in"),
  ("exflow (ood)", "exflow", False, "ood"),
  ("exflow+placement (ood)", "exflow", True, "ood"),
)
# Runs that must decode the same tokens: the modes and the placement change where experts run, not what they compute.
SAME_TOKENS = (("vanilla", "exflow"), ("exflow", "exflow+placement"), ("exflow (ood)", "exflow+placement (ood)"))


def parse_mesh(text: str) -> tuple[int, int]:
  """'NODESxGPUS' -> (nodes, GPUs per node); a ConfigError naming traffic.meshes otherwise."""
  parts = text.lower().split("x")
  require(
    len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts), "traffic.meshes", text, "NODESxGPUS, e.g. 2x4"
  )
  return int(parts[0]), int(parts[1])


def corpus_documents(path: str) -> dict[str, list[str]]:
  """The embedded corpus's texts by kind: 'profile' and 'in' (alternate stdlib docstrings), 'ood'."""
  by_kind = {"profile": [], "in": [], "ood": []}
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      url = record.get("url", "")
      if url.startswith(DISTRIBUTIONS["in"]):
        by_kind["profile" if len(by_kind["profile"]) <= len(by_kind["in"]) else "in"].append(record["text"])
      elif url.startswith(DISTRIBUTIONS["ood"]):
        by_kind["ood"].append(record["text"])
  require(
    all(by_kind.values()),
    "data.train_files",
    path,
    "the embedded corpus (documents with python-stdlib: and python-docs: urls)",
  )
  return by_kind


def token_rows(texts, tok, rows: int, length: int, tokens: int):
  """Batches [rows, length] of the texts' tokens packed end to end, `tokens` of them in all."""
  stream, need = [], -(-tokens // (rows * length)) * rows * length
  for text in texts:
    stream.extend(tok.encode(text))
    if len(stream) >= need:
      break
  require(len(stream) >= need, "traffic.profile_tokens", tokens, f"at most the {len(stream)} tokens of the texts")
  return list(np.asarray(stream[:need], np.int32).reshape(-1, rows, length))


def routing_profile(model, tok, docs: dict, seq_len: int, tokens: int) -> tuple[dict, dict]:
  """Each kind's teacher-forced routing traces [M, T, k] (`tokens` tokens of its documents in rows of seq_len) and
  their expert-to-expert transition counts [M-1, E, E]."""
  rows = model.mesh.devices.size
  traces = {kind: routing_traces(model, token_rows(docs[kind], tok, rows, seq_len, tokens)) for kind in KINDS}
  counts = {kind: affinity.affinity_counts(t, model.moe_cfg.num_experts) for kind, t in traces.items()}
  return traces, counts


def mean_top_affinity(counts_MxExE: np.ndarray) -> float:
  """How far routing is from random: the mean probability of a layer-j expert's likeliest next expert (uniform:
  1 / E)."""
  rows = counts_MxExE / counts_MxExE.sum(-1, keepdims=True).clip(1)
  return float(rows.max(-1).mean())


def per_token(transitions, tokens: int) -> dict:
  """(cross-node, cross-GPU) transitions -> per token, inside a node and across nodes."""
  cross_node, cross_gpu = transitions
  return {"intra_node": (cross_gpu - cross_node) / tokens, "inter_node": cross_node / tokens}


def measure_mesh(model, nodes: int, gpus: int, traces: dict, counts: dict, prompts: dict, traffic) -> dict:
  """One nodes x gpus mesh: the placement solved on the profile's counts, each kind's trace transitions under the
  contiguous and the solved placement, and every run of RUNS decoded (traffic: the config's traffic section)."""
  num_experts = model.moe_cfg.num_experts
  on = decode.on_mesh(model, mesh_lib.make_mesh(nodes, gpus))
  placement = solve.solve(
    counts["profile"], nodes, gpus, time_limit_s=traffic.time_limit_s, routing=model.moe_cfg.routing
  )
  models = {False: on, True: decode.with_placement(on, placement)}
  entry = {
    "placement": {
      "methods": list(placement.methods),
      "node_gap": placement.node_gap,
      "gpu_gap": placement.gpu_gap,
      "seconds": placement.seconds,
    },
    "decode": {},
    "traces": {},
  }
  identity = affinity.identity_placement(placement.placement.shape[0], num_experts, nodes * gpus)
  for kind in KINDS:
    tokens = traces[kind].shape[1]
    entry["traces"][kind] = {
      "exflow": per_token(affinity.transitions(counts[kind], identity, gpus), tokens),
      "exflow+placement": per_token(affinity.transitions(counts[kind], placement.placement, gpus), tokens),
    }
  outputs = {}
  for name, mode, placed, kind in RUNS:
    out = decode.generate(models[placed], prompts[kind], traffic.steps, mode=mode)
    outputs[name] = out.tokens
    entry["decode"][name] = {
      **out.exchange_rows,
      "allgather": out.allgather_rows,
      "tokens_per_second": out.tokens_per_second,
    }
  entry["same_tokens"] = bool(all((outputs[a] == outputs[b]).all() for a, b in SAME_TOKENS))
  return entry


def price(result: dict, topology, d_model: int) -> dict:
  """Adds each decode run's communication per step, priced on `topology` (`moejax.cost.decode`) with
  rows of d_model values: the exchanged hidden state, and for exflow's all-gather 2 x d_model per block."""
  item = np.dtype(result["dtype"]).itemsize
  result["priced"] = {"topology": topology.name, "d_model": d_model}
  for mesh, entry in result["meshes"].items():
    shape = parse_mesh(mesh)
    for name, mode, *_ in RUNS:
      run_ = entry["decode"][name]
      run_["priced"] = decode_cost.decode_step(
        mode,
        run_,
        result["batch"],
        result["moe_layers"],
        shape,
        d_model * item,
        2 * d_model * result["num_layers"] * item + 4,
        topology,
      )
  return result
