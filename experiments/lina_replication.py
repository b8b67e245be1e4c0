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

from moejax import cli, workdir_guard
from moejax.cost import model
from moejax.cost import topology as topology_lib
from moejax.replication import estimator
from moejax.replication import rebalance as rebalance_lib
from moejax.runtime import mesh as mesh_lib
from moejax.study.progress import Progress
from moejax.validation import is_int, is_number, require

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "lina_replication.py")

PAPER = {"median": 1.45, "p95": 1.63}  # Lina Sec. 1 (averages of Fig. 16)
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


def summarize(records, times, overheads):
  """Rows per policy: busiest/mean load, per-layer and per-batch time percentiles, speedups."""
  batches = max(r["batch"] for r in records) + 1
  out = []
  names = [*estimator.POLICIES, "lina_phase2+overheads"]
  base = times["no_replication"]
  for name in names:
    t = times["lina_phase2"] + overheads if name.endswith("overheads") else times[name]
    policy = name.split("+")[0]
    ratio = np.asarray([rebalance_lib.max_load_ratio(r["true"], r["tables"][policy]) for r in records])
    per_batch = np.bincount([r["batch"] for r in records], weights=t, minlength=batches)
    base_batch = np.bincount([r["batch"] for r in records], weights=base, minlength=batches)
    out.append(
      dict(
        policy=name,
        busiest_over_mean=float(ratio.mean()),
        busiest_over_mean_p95=float(np.quantile(ratio, 0.95)),
        layer_p50_ms=1e3 * float(np.median(t)),
        layer_p95_ms=1e3 * float(np.quantile(t, 0.95)),
        speedup_layer_p50=float(np.median(base) / np.median(t)),
        speedup_layer_p95=float(np.quantile(base, 0.95) / np.quantile(t, 0.95)),
        speedup_batch_p50=float(np.median(base_batch) / np.median(per_batch)),
        speedup_batch_p95=float(np.quantile(base_batch, 0.95) / np.quantile(per_batch, 0.95)),
      )
    )
  return out


def plot(rows, times, path):
  """Left: busiest/mean load per policy; right: CDF of the modelled layer times per policy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  rows = [r for r in rows if r["policy"] in estimator.POLICIES]  # the overheads leave the loads alone
  left.bar([r["policy"].replace("_", "\n") for r in rows], [r["busiest_over_mean"] for r in rows])
  left.axhline(1.0, color="gray", lw=0.8)
  left.set_ylabel("busiest / mean device load (mean)")
  left.tick_params(axis="x", labelsize=7)
  for name, t in times.items():
    right.plot(np.sort(t) * 1e3, np.linspace(0, 1, t.size), label=name)
  right.set_xscale("log")
  right.set_xlabel("modelled MoE layer time (ms)")
  right.set_ylabel("CDF over batches x layers")
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


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


def run(config, workdir: str) -> dict:
  """Plans and prices every held-out batch by each policy, prints the comparison, writes lina_replication.json and
  .png to `workdir`; returns the record."""
  if config.traces:
    traces = np.load(config.traces)
    experts = config.num_experts or int(traces.max()) + 1
    source = f"traces {config.traces}"
  else:
    experts = config.num_experts or 16
    s = config.synthetic
    traces = synthetic_traces(s.layers, s.tokens, experts, s.choices, s.noise, s.seed)
    source = "SYNTHETIC traces (no config.traces given): numbers below describe the generator, not a model"
    print("=" * 100, source, "=" * 100, sep="\n")
  ids = estimator.check_traces(traces, experts)
  split = int(config.profile_fraction * ids.shape[1])
  tables = estimator.profile(ids[:, :split], experts, config.path_length, config.top_k)
  print(
    f"{source}: L={ids.shape[0]}, T={ids.shape[1]}, K={ids.shape[2]}, E={experts}; profiled {split} tokens, "
    f"{sum(p.size for p in tables.paths)} paths"
  )
  nodes, gpus, topology = config.nodes, config.gpus_per_node, topology_lib.get(config.topology)
  held_out, batch_tokens = ids[:, split:], config.batch_tokens
  records, dropped = estimator.plan_batches(
    tables, held_out, batch_tokens, nodes, gpus, config.slots_per_device, config.window
  )
  print(f"planned {len(records)} (batch, layer) pairs; {dropped} trailing tokens outside a whole batch left out")
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
  overheads = 1e-3 * np.asarray([config.replan_ms if r["replanned"] else config.check_ms for r in records])
  rows = summarize(records, times, overheads)

  accuracy = float(np.mean([r["accurate"] for r in records]))
  accuracy_average = float(np.mean([r["accurate_moving_average"] for r in records]))
  replanned = float(np.mean([r["replanned"] for r in records]))
  l1 = {k: float(np.mean([r[f"l1_{k}"] for r in records])) for k in ("lina", "moving_average")}
  print(
    f"\nestimation accuracy (top-{2 * ids.shape[2]} sets agree; Lina Fig. 19: 58.41% / 54.16%, Table 5 l=3: "
    f"60.4% / 63.5%): Lina {accuracy:.1%}, moving average {accuracy_average:.1%}; phase-2 re-plans: "
    f"{replanned:.1%} (Lina Sec. 7.3.1: 23%)"
  )
  print(f"L1 distance of popularity shares: Lina {l1['lina']:.3f}, moving average {l1['moving_average']:.3f}")
  print(
    f"\n{'policy':22s} {'busiest/mean':>12s} {'p95':>6s} {'layer p50':>10s} {'p95':>8s} {'x p50':>6s} "
    f"{'x p95':>6s} {'batch x p50':>11s} {'x p95':>6s}"
  )
  for r in rows:
    print(
      f"{r['policy']:22s} {r['busiest_over_mean']:12.3f} {r['busiest_over_mean_p95']:6.3f} "
      f"{r['layer_p50_ms']:8.3f}ms {r['layer_p95_ms']:6.3f}ms {r['speedup_layer_p50']:6.2f} "
      f"{r['speedup_layer_p95']:6.2f} {r['speedup_batch_p50']:11.2f} {r['speedup_batch_p95']:6.2f}"
    )
  print(
    f"(x: speedup over no_replication; Lina reports {PAPER['median']}x median, {PAPER['p95']}x p95 inference "
    "time, Sec. 1 / Fig. 16)"
  )

  os.makedirs(workdir, exist_ok=True)
  record = dict(
    source=source,
    synthetic=not config.traces,
    shape=list(ids.shape),
    num_experts=experts,
    profiled_tokens=split,
    batch_tokens=batch_tokens,
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
    accuracy=accuracy,
    accuracy_moving_average=accuracy_average,
    replanned=replanned,
    l1=l1,
    rows=rows,
    paper=PAPER,
    check_ms=config.check_ms,
    replan_ms=config.replan_ms,
    per_layer={
      str(layer): float(np.mean([r["accurate"] for r in records if r["layer"] == layer]))
      for layer in sorted({r["layer"] for r in records})
    },
  )
  json_path, png_path = (os.path.join(workdir, f"lina_replication.{ext}") for ext in ("json", "png"))
  with open(json_path, "w") as f:
    json.dump(record, f, indent=1)
  plot(rows, {**times, "lina_phase2+overheads": times["lina_phase2"] + overheads}, png_path)
  print(f"wrote {json_path}, {png_path}")
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
