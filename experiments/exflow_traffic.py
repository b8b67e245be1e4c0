"""ExFlow's exchange traffic on simulated meshes: vanilla expert parallelism, context coherence, and
context coherence with the affinity placement, measured by decoding with a trained GPT-MoE.

  python -m experiments.exflow_traffic --workdir=/tmp/exflow                     # trains first (minutes)
  python -m experiments.exflow_traffic --workdir=/tmp/exflow --config.train_dir=/tmp/gen/train \\
      --config.traffic.meshes=2x4,2x8

The model (configs/exflow_traffic.py: configs/generate.py's) is trained on the embedded corpus, or loaded from
config.train_dir (`moejax.train.trained`); config.traffic holds the study's options. Its
documents are split by kind: standard-library docstrings (even ones: the profiling set the placement
is solved on; odd ones: the prompts measured) and the Python documentation topics (out of
distribution, ExFlow Table III's check). Per mesh the placement is `moejax.placement.solve` on the
profiling traces, and each mode decodes the same requests; the exchange rows per generated token are
counted from the exchanges themselves. Also reported: the transitions of teacher-forced traces under
the contiguous and the solved placement (many more tokens than the decode). Writes exflow_traffic.json
and exflow_traffic.png to --workdir.
"""

import json
import os
import sys

import numpy as np

from moejax import cli
from moejax.cost import decode as decode_cost
from moejax.cost import topology as topology_lib
from moejax.data import corpus as data_lib
from moejax.data.tokenizer import TokenizerError
from moejax.infer import decode, load
from moejax.placement import affinity, solve
from moejax.placement.traces import routing_traces
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.train import trained
from moejax.validation import ConfigError, is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "exflow_traffic.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/exflow_traffic.py).")
_WORKDIR = cli.define_workdir("Directory for the results (and the training run without config.train_dir).")

DISTRIBUTIONS = {"in": "python-stdlib:", "ood": "python-docs:"}  # url prefixes of the embedded corpus
# (name, decode mode, with the placement, prompts)
RUNS = (
  ("vanilla", "vanilla", False, "in"),
  ("exflow", "exflow", False, "in"),
  ("exflow+placement", "exflow", True, "in"),
  ("exflow (ood)", "exflow", False, "ood"),
  ("exflow+placement (ood)", "exflow", True, "ood"),
)


def parse_mesh(text: str) -> tuple[int, int]:
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


def per_token(transitions, tokens: int) -> dict:
  cross_node, cross_gpu = transitions
  return {"intra_node": (cross_gpu - cross_node) / tokens, "inter_node": cross_node / tokens}


def run(config, workdir: str, meshes) -> dict:
  t = config.traffic
  model, tok, step = trained.trained_model(config, workdir)
  train_workdir = trained.run_dir(config, workdir)
  summary_path = os.path.join(train_workdir, "summary.json")
  training = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      training = json.load(f)
  docs = corpus_documents(data_lib.corpus_files("", load.cache_dir(config, train_workdir))[0])
  rows = model.mesh.devices.size
  traces = {
    kind: routing_traces(model, token_rows(docs[kind], tok, rows, config.seq_len, t.profile_tokens))
    for kind in ("profile", "in", "ood")
  }
  num_experts = model.moe_cfg.num_experts
  counts = {kind: affinity.affinity_counts(t, num_experts) for kind, t in traces.items()}
  affinity_rows = counts["profile"] / counts["profile"].sum(-1, keepdims=True).clip(1)
  prompts = {kind: load.prompts_from(docs[kind], tok, t.batch, t.prompt_len) for kind in ("in", "ood")}
  result = {
    "checkpoint_step": step,
    "train_steps": training.get("steps"),
    "first_task_loss": training.get("first_task_loss"),
    "final_task_loss": training.get("final_task_loss"),
    "moe_layers": model.cfg.num_moe_layers,
    "num_experts": num_experts,
    "profile_tokens": traces["profile"].shape[1],
    # How far routing is from random: the mean probability of a layer-j expert's likeliest next
    # expert (uniform: 1 / E).
    "mean_top_affinity": float(affinity_rows.max(-1).mean()),
    "uniform_affinity": 1 / num_experts,
    "batch": t.batch,
    "prompt_len": t.prompt_len,
    "steps": t.steps,
    "meshes": {},
    "d_model": model.cfg.d_model,
    "num_layers": model.cfg.num_layers,
    "dtype": model.cfg.dtype,
  }
  print(
    f"model from step {step}; affinity: likeliest next expert {result['mean_top_affinity']:.3f} "
    f"(uniform {1 / num_experts:.3f})",
    flush=True,
  )
  for nodes, gpus in meshes:
    mesh = mesh_lib.make_mesh(nodes, gpus)
    on = decode.on_mesh(model, mesh)
    placement = solve.solve(counts["profile"], nodes, gpus, time_limit_s=t.time_limit_s, routing=model.moe_cfg.routing)
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
    for kind in ("profile", "in", "ood"):
      tokens = traces[kind].shape[1]
      entry["traces"][kind] = {
        "exflow": per_token(affinity.transitions(counts[kind], identity, gpus), tokens),
        "exflow+placement": per_token(affinity.transitions(counts[kind], placement.placement, gpus), tokens),
      }
    outputs = {}
    for name, mode, placed, kind in RUNS:
      out = decode.generate(models[placed], prompts[kind], t.steps, mode=mode)
      outputs[name] = out.tokens
      entry["decode"][name] = {
        **out.exchange_rows,
        "allgather": out.allgather_rows,
        "tokens_per_second": out.tokens_per_second,
      }
      print(f"{nodes}x{gpus} {name:24s} rows/token {out.exchange_rows}", flush=True)
    entry["same_tokens"] = bool(
      all(
        (outputs[a] == outputs[b]).all()
        for a, b in (("vanilla", "exflow"), ("exflow", "exflow+placement"), ("exflow (ood)", "exflow+placement (ood)"))
      )
    )
    result["meshes"][f"{nodes}x{gpus}"] = entry
  return price(result, topology_lib.get(t.topology), t.price_d_model or model.cfg.d_model)


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


def table(result: dict) -> str:
  names = [name for name, *_ in RUNS]
  lines = [
    f"{'mesh':6s} " + " ".join(f"{n:>24s}" for n in names),
    " " * 7 + " ".join(f"{'in-node / cross-node':>24s}" for _ in names),
  ]
  for mesh, entry in result["meshes"].items():
    cells = [f"{entry['decode'][n]['intra_node']:.3f} / {entry['decode'][n]['inter_node']:.3f}" for n in names]
    lines.append(f"{mesh:6s} " + " ".join(f"{c:>24s}" for c in cells))
  priced = result["priced"]
  lines += [
    "",
    f"communication per decode step on {priced['topology']} at d_model {priced['d_model']}: "
    "exchanges + all-gather (us)",
  ]
  for mesh, entry in result["meshes"].items():
    cells = [
      f"{entry['decode'][n]['priced']['exchange_s'] * 1e6:.1f} + {entry['decode'][n]['priced']['allgather_s'] * 1e6:.1f}"
      for n in names
    ]
    lines.append(f"{mesh:6s} " + " ".join(f"{c:>24s}" for c in cells))
  lines += [
    "",
    "teacher-forced traces: transitions between MoE layers per token, in-node / cross-node",
    f"{'mesh':6s} "
    + " ".join(f"{k + ' ' + p:>26s}" for k in ("profile", "in", "ood") for p in ("exflow", "+placement")),
  ]
  for mesh, entry in result["meshes"].items():
    cells = [
      f"{entry['traces'][k][p]['intra_node']:.3f} / {entry['traces'][k][p]['inter_node']:.3f}"
      for k in ("profile", "in", "ood")
      for p in ("exflow", "exflow+placement")
    ]
    lines.append(f"{mesh:6s} " + " ".join(f"{c:>26s}" for c in cells))
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [name for name, *_ in RUNS]
  meshes = list(result["meshes"])
  fig, ax = plt.subplots(figsize=(10, 4.5))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    x = [j + (i - (len(names) - 1) / 2) * width for j in range(len(meshes))]
    inside = [result["meshes"][m]["decode"][name]["intra_node"] for m in meshes]
    cross = [result["meshes"][m]["decode"][name]["inter_node"] for m in meshes]
    bars = ax.bar(x, cross, width, label=name, color=f"C{i}", hatch="//" if "ood" in name else None)
    ax.bar(x, inside, width, bottom=cross, color=f"C{i}", alpha=0.45, hatch=bars.patches[0].get_hatch())
  ax.set_xticks(range(len(meshes)), [f"{m} mesh" for m in meshes])
  ax.set_ylabel("exchange rows per generated token")
  ax.set_title(
    f"Exchange rows per generated token ({result['moe_layers']} MoE layers, {result['num_experts']} "
    "experts, top-1)\nsolid: cross-node; light: cross-GPU inside a node; hatched: out of distribution"
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def check(traffic) -> list[tuple[int, int]]:
  """The traffic section's fields; returns its meshes as (nodes, GPUs per node). Errors name the field."""
  for field in ("profile_tokens", "batch", "prompt_len", "steps"):
    require(is_int(traffic[field]), f"traffic.{field}", traffic[field], "a positive int")
  require(
    is_int(traffic.price_d_model, 0),
    "traffic.price_d_model",
    traffic.price_d_model,
    "an int >= 0 (0: the model's own width)",
  )
  require(
    is_number(traffic.time_limit_s) and traffic.time_limit_s > 0,
    "traffic.time_limit_s",
    traffic.time_limit_s,
    "a number of seconds > 0",
  )
  require(
    traffic.topology in topology_lib.PRESETS,
    "traffic.topology",
    traffic.topology,
    f"one of {sorted(topology_lib.PRESETS)}",
  )
  require(len(traffic.meshes) > 0, "traffic.meshes", traffic.meshes, "meshes as NODESxGPUS, e.g. 2x4,2x8")
  return [parse_mesh(m) for m in traffic.meshes]


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  try:
    meshes = check(config.traffic)
    if distributed.initialize() == "single":
      mesh_lib.simulate_cpu_devices(max([config.mesh.nodes * config.mesh.gpus_per_node] + [n * m for n, m in meshes]))
    result = run(config, workdir, meshes)
  except (ConfigError, mesh_lib.MeshError, TokenizerError) as e:
    sys.exit(f"error: {e}")
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "exflow_traffic.json"), "w") as f:
    json.dump(result, f, indent=1)
  plot(result, os.path.join(workdir, "exflow_traffic.png"))
  print(table(result), flush=True)


if __name__ == "__main__":
  cli.run(main)
