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

from moejax import cli
from moejax.cost import topology as topology_lib
from moejax.data import corpus as data_lib
from moejax.data.tokenizer import TokenizerError
from moejax.infer import load
from moejax.runtime import distributed
from moejax.runtime import mesh as mesh_lib
from moejax.study import exflow_traffic as traffic_lib
from moejax.study.exflow_traffic import RUNS
from moejax.train import trained
from moejax.validation import ConfigError, is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "exflow_traffic.py")
_CONFIG = cli.define_config(_DEFAULT_CONFIG, "Study config file (configs/exflow_traffic.py).")
_WORKDIR = cli.define_workdir("Directory for the results (and the training run without config.train_dir).")


def training_summary(train_workdir: str) -> dict:
  """The training run's summary.json ({} when the run left none)."""
  path = os.path.join(train_workdir, "summary.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def run(config, workdir: str, meshes) -> dict:
  """The model trained (or loaded), profiled, then measured on each mesh and priced: the record."""
  t = config.traffic
  model, tok, step = trained.trained_model(config, workdir)
  train_workdir = trained.run_dir(config, workdir)
  training = training_summary(train_workdir)
  docs = traffic_lib.corpus_documents(data_lib.corpus_files("", load.cache_dir(config, train_workdir))[0])
  traces, counts = traffic_lib.routing_profile(model, tok, docs, config.seq_len, t.profile_tokens)
  prompts = {kind: load.prompts_from(docs[kind], tok, t.batch, t.prompt_len) for kind in ("in", "ood")}
  num_experts = model.moe_cfg.num_experts
  result = {
    "checkpoint_step": step,
    "train_steps": training.get("steps"),
    "first_task_loss": training.get("first_task_loss"),
    "final_task_loss": training.get("final_task_loss"),
    "moe_layers": model.cfg.num_moe_layers,
    "num_experts": num_experts,
    "profile_tokens": traces["profile"].shape[1],
    "mean_top_affinity": traffic_lib.mean_top_affinity(counts["profile"]),
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
    entry = traffic_lib.measure_mesh(model, nodes, gpus, traces, counts, prompts, t)
    for name, *_ in RUNS:
      rows = {k: v for k, v in entry["decode"][name].items() if k in ("intra_node", "inter_node")}
      print(f"{nodes}x{gpus} {name:24s} rows/token {rows}", flush=True)
    result["meshes"][f"{nodes}x{gpus}"] = entry
  return traffic_lib.price(result, topology_lib.get(t.topology), t.price_d_model or model.cfg.d_model)


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
  return [traffic_lib.parse_mesh(m) for m in traffic.meshes]


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
