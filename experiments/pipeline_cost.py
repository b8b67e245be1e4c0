"""DeepSeek-V3's training step, priced from each schedule's timetable (`moejax.pipeline.cost`), on a topology preset.

  python -m experiments.pipeline_cost                                              # prints the tables
  python -m experiments.pipeline_cost --workdir=benchmarks/results/2026-11-27-cpu  # and pipeline_cost.json

One layer of DeepSeek-V3 (`moejax.models.presets.PUBLISHED`: d 7168, MLA with 128 heads, 256 routed experts of
2048 and a shared one, top-8; 3 dense layers of d_ff 18432 first, 58 MoE layers) on T = config.tokens tokens per
device per micro-batch, experts spread evenly over 64 devices (8 nodes x 8, the report's expert parallelism):
  compute  FLOPs at the topology's rate (`cost.model.default_rate`): 2 T per weight of the attention's matrices, the
           causal scores (2 T S H (qk + v) / 2), the router, k routed and the shared expert's SwiGLU FFNs (each
           token's k choices on the devices that hold them: T k rows a device on average), the dense layers' FFN;
           B = 2 F (the input's and the weights' gradients), W = F (assumed, the usual count).
  exchange the real layer's rows per token on the node_first path with dedup (config.traffic, the record of
           experiments/wire_traffic.py: its node hop's and its gpu hop's rows at the uniform router), each hop one
           all-to-all over its groups (`cost.collectives.all_to_all`, the rows spread evenly over the group's
           peers); the forward dispatches in FP8 and combines in BF16, the backward moves both gradients in BF16.
A stage holds 1/p of the 61 layers (their sum over p; the embeddings, head and MTP module not counted). Schedules:
  no_overlap   no pipeline: each of the p devices runs every layer on m/p micro-batches, exchanges exposed;
  two_batch    the same, micro-batches in pairs (one's exchanges under the other's compute);
  1f1b         p stages, exchanges exposed;
  dualpipe     p stages, F&B slots hiding one micro-batch's exchanges under the other's compute.
Also what each schedule keeps in flight at p stages (`moejax.pipeline.memory.per_device`).
"""

import json
import os

import numpy as np

from moejax import cli
from moejax.cost import collectives
from moejax.cost import model as cost_model
from moejax.cost import topology as topology_lib
from moejax.models.presets import PUBLISHED
from moejax.pipeline import cost, memory, schedules
from moejax.runtime import mesh as mesh_lib
from moejax.validation import ConfigError, is_int, require

_ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
_DEFAULT_CONFIG = os.path.join(_ROOT, "configs", "pipeline_cost.py")
NODES, GPUS = 8, 8  # DeepSeek-V3 report Sec. 3.2: 64-way expert parallelism over 8 nodes
MOE_LAYERS, DENSE_LAYERS = 58, 3
SCHEDULES = ("none", "two_batch", "1f1b", "dualpipe")  # priced (`moejax.pipeline.schedules`; 'none': no_overlap)


def layer_flops(tokens: int) -> dict:
  """Forward FLOPs of one MoE and one dense layer of DeepSeek-V3 on `tokens` tokens of one sequence each S long."""
  model, moe = PUBLISHED["deepseek_v3"].model, PUBLISHED["deepseek_v3"].moe
  d, h, qk, v = (
    moe["d_model"],
    model["num_heads"],
    model["qk_nope_head_dim"] + model["qk_rope_head_dim"],
    model["v_head_dim"],
  )
  attention = (
    d * model["q_lora_rank"]
    + model["q_lora_rank"] * h * qk
    + d * (model["kv_lora_rank"] + model["qk_rope_head_dim"])
    + model["kv_lora_rank"] * h * (model["qk_nope_head_dim"] + v)
    + h * v * d
  )
  scores = 2 * tokens * tokens * h * (qk + v) / 2
  swiglu = lambda width: 3 * d * width
  experts = moe["top_k"] * swiglu(moe["d_ff"]) + moe["num_shared_experts"] * swiglu(moe["d_ff"])
  router = d * moe["num_experts"]
  common = 2 * tokens * attention + scores
  return {"moe": common + 2 * tokens * (experts + router), "dense": common + 2 * tokens * swiglu(model["d_ff"])}


def exchange_s(tokens: int, record: dict, topology) -> dict:
  """Seconds of one MoE layer's all-to-alls for `tokens` tokens a device, forward (FP8 dispatch, BF16 combine) and
  backward (both BF16), from the record's node_first + dedup rows per token."""
  case = next(c for c in record["cases"] if c["preset"] == "deepseek_v3" and c["router"] == "uniform")
  run = next(r for r in case["runs"] if r["path"] == "node_first" and r["dedup"])
  out, back = run["row_bytes"]["fp8"]["out"], run["row_bytes"]["bf16"]["back"]
  total = {"forward": 0.0, "backward": 0.0}
  for hop in run["hops"]:
    rows = tokens * (hop["inter_rows_per_token"] + hop["intra_rows_per_token"])
    group_AxA = mesh_lib.same_group(hop["hop"], NODES, GPUS)
    peers_AxA = group_AxA & ~np.eye(NODES * GPUS, dtype=bool)
    share_AxA = peers_AxA / peers_AxA.sum(axis=1, keepdims=True)
    price = lambda row_bytes: collectives.all_to_all(share_AxA * rows * row_bytes, group_AxA, GPUS, topology).time_s
    total["forward"] += price(out) + price(back)
    total["backward"] += 2 * price(back)
  return total


def model_cost(config) -> tuple[cost.StageCost, dict]:
  """All 61 layers' times for one micro-batch (a stage's is 1/p of them), and the terms they come from."""
  topology = topology_lib.get(config.topology)
  rate, rate_source = cost_model.default_rate(topology)
  flops = layer_flops(config.tokens)
  with open(config.traffic if os.path.isabs(config.traffic) else os.path.join(_ROOT, config.traffic)) as f:
    a2a = exchange_s(config.tokens, json.load(f), topology)
  forward = (MOE_LAYERS * flops["moe"] + DENSE_LAYERS * flops["dense"]) / rate
  whole = cost.StageCost(
    f=forward, b=2 * forward, w=forward, a2a_f=MOE_LAYERS * a2a["forward"], a2a_b=MOE_LAYERS * a2a["backward"]
  )
  return whole, {"rate_flops": rate, "rate_source": rate_source, "layer_flops": flops, "layer_a2a_s": a2a}


def run(config) -> dict:
  whole, terms = model_cost(config)
  p = config.stages
  stage = whole.scaled(1.0 / p)
  rows = []
  for m in config.micro_batches:
    for schedule in map(schedules.of, SCHEDULES):
      if schedule.pipelined:
        name, step = schedule.name, cost.step_time(schedule.name, p, m, stage)
      else:  # every layer on each device: named no_overlap, or two_batch
        table = cost.one_device(m // p, whole, two_batch=schedule.halves)
        name, step = table.name, table.makespan
      rows.append({"schedule": name, "micro_batches": m, "step_s": step})
  in_flight = [
    {"schedule": s, **memory.per_device(s, p, max(config.micro_batches), schedules.of(s).chunks(2))}
    for s in schedules.PIPELINED
  ]
  return {"config": config.to_dict(), "stage": vars(stage), "terms": terms, "rows": rows, "in_flight": in_flight}


def markdown(record: dict) -> str:
  """docs/pipelines.md's tables: step seconds per schedule and m (and against no_overlap), what stays in flight."""
  ms = sorted({r["micro_batches"] for r in record["rows"]})
  base = {}  # each m's first row: no_overlap's
  for r in record["rows"]:
    base.setdefault(r["micro_batches"], r["step_s"])
  out = ["| schedule | " + " | ".join(f"step s, m = {m}" for m in ms) + " |", "|---|" + "--:|" * len(ms)]
  for schedule in dict.fromkeys(r["schedule"] for r in record["rows"]):
    cells = [
      f"{r['step_s']:.3f} ({r['step_s'] / base[r['micro_batches']]:.2f}x)"
      for r in record["rows"]
      if r["schedule"] == schedule
    ]
    out.append(f"| {schedule} | " + " | ".join(cells) + " |")
  out += [
    "",
    "| schedule | stage-activations in flight (busiest device) | stages of parameters a device holds |",
    "|---|--:|--:|",
  ]
  out += [f"| {r['schedule']} | {r['activation_stages']:g} | {r['parameter_stages']} |" for r in record["in_flight"]]
  return "\n".join(out)


def check(config) -> None:
  require(
    config.topology in topology_lib.PRESETS, "topology", config.topology, f"one of {sorted(topology_lib.PRESETS)}"
  )
  require(is_int(config.stages, 2) and config.stages % 2 == 0, "stages", config.stages, "an even int >= 2")
  require(
    isinstance(config.micro_batches, tuple)
    and config.micro_batches
    and all(is_int(m) and m % config.stages == 0 and m >= 2 * config.stages for m in config.micro_batches),
    "micro_batches",
    config.micro_batches,
    f"a tuple of multiples of stages={config.stages}, each >= 2 x stages "
    "(no_overlap runs m/p on each device; DualPipe needs 2p)",
  )
  require(is_int(config.tokens), "tokens", config.tokens, "a positive int")
  path = config.traffic if os.path.isabs(config.traffic) else os.path.join(_ROOT, config.traffic)
  if not os.path.isfile(path):
    raise ConfigError(
      f"config field traffic={config.traffic!r}: no such file (experiments/wire_traffic.py's record)", "traffic"
    )


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  check(config)
  record = run(config)
  print(markdown(record), flush=True)
  if workdir:
    cli.write_json(workdir, "pipeline_cost.json", record)


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Config file (configs/pipeline_cost.py).")
  _WORKDIR = cli.define_workdir(
    "Directory for pipeline_cost.json (optional: without it, the tables only).", required=False
  )
  cli.run(main)
