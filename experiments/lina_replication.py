"""Lina's popularity-based expert replication (ATC'23, Sec. 5) replayed on routing traces.

Profiles the path tables (`moejax.replication.estimator`) on the first config.profile_fraction of the
tokens of config.traces ([M, T] or [M, T, K] int expert ids, tokens in batch order, saved with np.save),
then plans the slots of every later batch and scheduled layer (the fourth onwards with l=3) by each
policy: no replication (expert e alone on device e // (E / A)), a moving average of the recent
batches' loads, Lina phase 1 (the estimate), Lina phase 2 (re-planned on the true load when the top-2k
sets differ) and the oracle (the true load). Reported: estimation accuracy (Lina Sec. 7.3.2: the
top-2k sets agree), the L1 distance of the popularity shares, the busiest device's load over the mean,
and the per-layer time the cluster cost model prices for the batch's real traffic (dispatch, expert
compute of the busiest device, combine) on config.topology; Lina reports 1.45x at the median and 1.63x at
p95 for inference time against its baseline (Sec. 1; Fig. 16). Lina's scheduling overheads (1.45 ms per
phase-2 check, about 6.2 ms per re-plan, Sec. 7.3.1) are measured on its own system: the row
'lina_phase2+overheads' adds them, the others carry none.

Without config.traces, synthetic traces are generated (and the output says so): sequences of a random
topic, tokens of Zipf-popular types whose popularity order depends on the topic, each type routed at
each layer to a fixed expert list with probability 1 - noise, else to a Zipf-popular expert.

Traces of a trained model: `moejax.placement.traces.routing_traces(model, batches)` returns them as
[L, T, K] in batch order (experiments/record_traces.py records them); pass the array's path as config.traces
(Lina profiles on training data and schedules on the test set: record the profiled part first, the evaluated part
after it). Writes lina_replication.json and lina_replication.png to --workdir.

  python -m experiments.lina_replication --workdir=/tmp/lina                         # configs/lina_replication.py
  python -m experiments.lina_replication --workdir=/tmp/lina --config.traces=/path/traces.npy --config.nodes=4
"""

import json
import os

import numpy as np

from experiments.lina_replication_report import (
  PAPER,
  estimation_stats,
  per_layer_accuracy,
  plot,
  print_report,
  summarize,
)
from moejax import cli, workdir_guard
from moejax.cost import model
from moejax.cost import topology as topology_lib
from moejax.replication import estimator
from moejax.runtime import mesh as mesh_lib
from moejax.study.progress import Progress
from moejax.validation import is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "lina_replication.py")

SEQ_LEN, TYPES, TOPICS = 4096, 64, 8  # synthetic documents (one topic each), token types, topics


def synthetic_traces(layers, tokens, experts, choices, noise, seed) -> np.ndarray:
  """[L, T, K] int64 expert ids with inter-layer structure (module docstring)."""
  rng = np.random.default_rng(seed)
  type_pop = 1.0 / np.arange(1, TYPES + 1) ** 1.1
  topic_order = np.stack([rng.permutation(TYPES) for _ in range(TOPICS)])
  topic = np.repeat(rng.integers(TOPICS, size=-(-tokens // SEQ_LEN)), SEQ_LEN)[:tokens]
  kind = topic_order[topic, rng.choice(TYPES, size=tokens, p=type_pop / type_pop.sum())]
  expert_pop = 1.0 / np.arange(1, experts + 1) ** 1.2
  out = np.empty((layers, tokens, choices), np.int64)
  for layer in range(layers):
    route = np.stack([rng.permutation(experts)[:choices] for _ in range(TYPES)])  # [TYPES, K]
    stray = rng.permutation(experts)[rng.choice(experts, size=(tokens, choices), p=expert_pop / expert_pop.sum())]
    out[layer] = np.where(rng.random((tokens, choices)) < noise, stray, route[kind])
  return out


def layer_time_s(true_E, src_rows_AxE, slot_expert, mesh_shape, topology, config) -> float:
  """Modelled forward of one MoE layer: its rows split over each expert's replicas in proportion to the
  replicas a device holds, dispatch + combine all-to-all and the busiest device's expert FFN (config.d_model,
  d_ff, bytes_per_element)."""
  experts = true_E.size
  placed = np.stack([np.bincount(row, minlength=experts) for row in slot_expert], axis=1)  # [E, D]
  traffic_AxA = src_rows_AxE @ (placed / placed.sum(1, keepdims=True))
  flops = model.expert_flops(traffic_AxA.sum(0), config.d_model, config.d_ff)
  return model.price_from_traffic(
    traffic_AxA[None], [mesh_lib.AXES], mesh_shape, config.d_model * config.bytes_per_element, flops, topology
  ).total_s


def source_rows(batch_MxTxK, layer, devices, experts) -> np.ndarray:
  """[D, E] rows each device sends to each expert: the batch's tokens split evenly over devices in order."""
  ids = batch_MxTxK[layer]
  device = np.arange(ids.shape[0]) * devices // ids.shape[0]
  rows = np.zeros((devices, experts))
  np.add.at(rows, (np.repeat(device, ids.shape[1]), ids.ravel()), 1.0)
  return rows


def check(config) -> None:
  """Every field before anything runs; errors name the field."""
  require(
    not config.traces or os.path.isfile(config.traces),
    "traces",
    config.traces,
    "'' (synthetic) or an existing .npy file",
  )
  for field in ("num_experts", "top_k"):
    require(config[field] is None or is_int(config[field]), field, config[field], "None or a positive int")
  for field in (
    "nodes",
    "gpus_per_node",
    "slots_per_device",
    "batch_tokens",
    "path_length",
    "window",
    "d_model",
    "d_ff",
    "bytes_per_element",
  ):
    require(is_int(config[field]), field, config[field], "a positive int")
  require(
    is_number(config.profile_fraction) and 0 < config.profile_fraction < 1,
    "profile_fraction",
    config.profile_fraction,
    "a number in (0, 1)",
  )
  require(
    config.topology in topology_lib.PRESETS, "topology", config.topology, f"one of {sorted(topology_lib.PRESETS)}"
  )
  for field in ("check_ms", "replan_ms"):
    require(is_number(config[field]) and config[field] >= 0, field, config[field], "a number >= 0")
  synthetic = config.synthetic
  for field in ("layers", "tokens", "choices"):
    require(is_int(synthetic[field]), f"synthetic.{field}", synthetic[field], "a positive int")
  require(
    is_number(synthetic.noise) and 0 <= synthetic.noise <= 1,
    "synthetic.noise",
    synthetic.noise,
    "a probability in [0, 1]",
  )
  require(is_int(synthetic.seed, 0), "synthetic.seed", synthetic.seed, "an int >= 0")


def load_traces(config) -> tuple[np.ndarray, int, str]:
  """(traces, experts, source): config.traces loaded, or synthetic ones generated (announced in a banner); the
  experts config.num_experts or, unset, the traces' largest id + 1 (16 for synthetic ones)."""
  if config.traces:
    traces = np.load(config.traces)
    return traces, config.num_experts or int(traces.max()) + 1, f"traces {config.traces}"
  experts = config.num_experts or 16
  s = config.synthetic
  traces = synthetic_traces(s.layers, s.tokens, experts, s.choices, s.noise, s.seed)
  source = "SYNTHETIC traces (no config.traces given): numbers below describe the generator, not a model"
  print("=" * 100, source, "=" * 100, sep="\n")
  return traces, experts, source


def price_records(records, held_out, experts: int, topology, config) -> dict:
  """Policy -> [len(records)] modelled layer seconds of each planned (batch, layer) on its batch of `held_out`
  ([L, T, K] expert ids), with progress lines."""
  nodes, gpus, batch_tokens = config.nodes, config.gpus_per_node, config.batch_tokens
  times = {p: np.empty(len(records)) for p in estimator.POLICIES}
  progress = Progress(len(records))
  for i, r in enumerate(records):
    batch = held_out[:, r["batch"] * batch_tokens : (r["batch"] + 1) * batch_tokens]
    rows = source_rows(batch, r["layer"], nodes * gpus, experts)
    for policy in estimator.POLICIES:
      times[policy][i] = layer_time_s(r["true"], rows, r["tables"][policy], (nodes, gpus), topology, config)
    line = progress.step("(batch, layer) pairs priced")
    if i % 100 == 99 or i == len(records) - 1:
      print(f"  {line}", flush=True)
  return times


def write_outputs(record: dict, times: dict, overheads, workdir: str) -> None:
  """lina_replication.json (the record) and .png (its rows, the policies' times and phase 2's with overheads)."""
  json_path, png_path = (os.path.join(workdir, f"lina_replication.{ext}") for ext in ("json", "png"))
  with open(json_path, "w") as f:
    json.dump(record, f, indent=1)
  plot(record["rows"], {**times, "lina_phase2+overheads": times["lina_phase2"] + overheads}, png_path)
  print(f"wrote {json_path}, {png_path}")


def run(config, workdir: str) -> dict:
  """Plans and prices every held-out batch by each policy, prints the comparison, writes lina_replication.json and
  .png to `workdir`; returns the record."""
  traces, experts, source = load_traces(config)
  ids = estimator.check_traces(traces, experts)
  split = int(config.profile_fraction * ids.shape[1])
  tables = estimator.profile(ids[:, :split], experts, config.path_length, config.top_k)
  print(
    f"{source}: L={ids.shape[0]}, T={ids.shape[1]}, K={ids.shape[2]}, E={experts}; profiled {split} tokens, "
    f"{sum(p.size for p in tables.paths)} paths"
  )
  nodes, gpus, topology = config.nodes, config.gpus_per_node, topology_lib.get(config.topology)
  held_out = ids[:, split:]
  records, dropped = estimator.plan_batches(
    tables, held_out, config.batch_tokens, nodes, gpus, config.slots_per_device, config.window
  )
  print(f"planned {len(records)} (batch, layer) pairs; {dropped} trailing tokens outside a whole batch left out")
  times = price_records(records, held_out, experts, topology, config)
  overheads = 1e-3 * np.asarray([config.replan_ms if r["replanned"] else config.check_ms for r in records])
  rows = summarize(records, times, overheads)
  stats = estimation_stats(records)
  print_report(stats, rows, ids.shape[2])

  os.makedirs(workdir, exist_ok=True)
  record = dict(
    source=source,
    synthetic=not config.traces,
    shape=list(ids.shape),
    num_experts=experts,
    profiled_tokens=split,
    batch_tokens=config.batch_tokens,
    dropped_tokens=dropped,
    nodes=nodes,
    gpus_per_node=gpus,
    slots_per_device=config.slots_per_device,
    path_length=config.path_length,
    top_k=tables.top_k,
    window=config.window,
    topology=topology.name,
    d_model=config.d_model,
    d_ff=config.d_ff,
    **stats,
    rows=rows,
    paper=PAPER,
    check_ms=config.check_ms,
    replan_ms=config.replan_ms,
    per_layer=per_layer_accuracy(records),
  )
  write_outputs(record, times, overheads, workdir)
  return record


def main(argv):
  del argv
  config = _CONFIG.value
  check(config)
  workdir_guard.claim(_WORKDIR.value, "experiments.lina_replication")  # never into another program's workdir
  run(config, _WORKDIR.value)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Replay config file (configs/lina_replication.py).")
  _WORKDIR = cli.define_workdir("Directory for lina_replication.json and .png.")
  cli.run(main)
