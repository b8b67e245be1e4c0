"""Memory planner: per-device bytes of a training config's parameters, optimizer states, gradients, activations and
exchange buffers, from the compiled train step's memory analysis on simulated CPU devices of the config's mesh
(nothing allocated: the step is lowered from abstract arrays), beside an analytic count, with a verdict against the
device's memory.

  python -m experiments.memory --config=configs/memory.py:decoder:deepseek_v3,published --config.model.fsdp=True
  python -m experiments.memory --workdir=benchmarks/results/2026-11-25-cpu            # every preset: memory.json
  python -m experiments.memory --config=configs/memory.py:decoder:qwen3_moe --config.planner.whole=True \\
      --config.planner.device_gb=0.01

configs/memory.py names what is planned (PRESETS' rows, or one training config) and the planner's options; with
--workdir the rows go to memory.json there. A scanned model (model.scan_layers, the default) is compiled whole; an
unrolled one as a few blocks ((dense, MoE) = (1,1), (2,1), (1,2)) scaled by the block counts
(`moejax.study.memory_compile.scale`), unless config.planner.whole. XLA:CPU has no ragged all-to-all, so a 'ragged'
collective compiles as 'padded' (the same buffer bounds).
docs/memory.md explains every column.
"""

import os
import sys
import time

from moejax import cli
from moejax.study import memory as memory_lib
from moejax.study import memory_compile, memory_report, memory_rows
from moejax.study.memory import GB

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "memory.py")

# A micro-batch of one 4096-token sequence per device: the published configs' 2 sequences per device in 2 micro-batches.
_ONE_SEQUENCE = dict(micro_batches=2)
PRESETS = {  # name: (config spec of configs/decoder.py, top-level, model, moe and mesh overrides, explain)
  "deepseek_v3_fsdp_remat": (
    "deepseek_v3,published",
    _ONE_SEQUENCE,
    dict(fsdp=True, remat="full"),
    dict(path="gpu_first"),
    {},
    True,
  ),
  "deepseek_v3_fsdp_remat_seq2048": (
    "deepseek_v3,published",
    dict(micro_batches=2, seq_len=2048),
    dict(fsdp=True, remat="full"),
    dict(path="gpu_first"),
    {},
    False,
  ),
  "deepseek_v3_remat": (
    "deepseek_v3,published",
    _ONE_SEQUENCE,
    dict(fsdp=False, remat="full"),
    dict(path="gpu_first"),
    {},
    False,
  ),
  "qwen3_moe": ("qwen3_moe,published", _ONE_SEQUENCE, {}, {}, {}, False),
  "qwen3_moe_fsdp_remat": ("qwen3_moe,published", _ONE_SEQUENCE, dict(fsdp=True, remat="full"), {}, {}, False),
  "mixtral": ("mixtral,published", _ONE_SEQUENCE, {}, {}, {}, False),
  "mixtral_fsdp_remat": ("mixtral,published", _ONE_SEQUENCE, dict(fsdp=True, remat="full"), {}, {}, False),
  "mixtral_2x8_edp": (
    "mixtral,published",
    dict(batch_size=32, micro_batches=2),
    {},
    dict(expert_data_parallel=True, num_nodes=2),
    dict(nodes=2),
    False,
  ),
}
# Pipelined rows (analytic only: `plan_pipelined`): name -> (a PRESETS row, mesh.nodes of a stage's nodes x 8 GPUs,
# schedule, stages, virtual_stages, micro-batches of one 4096-token sequence a device). DeepSeek-V3 as trained: 16
# stages of 8 x 8 GPUs (EP 64; its 2048 GPUs are two such replicas, data parallel), DualPipe; on 32 x 8, 16 stages
# of 2 x 8 GPUs (DualPipeV's 8 devices of 4 x 8), 32 micro-batches (DualPipe's least at 16 stages: m >= 2p).
PIPELINED = {
  "deepseek_v3_pp16_ep64_dualpipe": ("deepseek_v3_fsdp_remat", 8, "dualpipe", 16, 1, 32),
  **{
    f"deepseek_v3_32x8_{s}": (
      "deepseek_v3_fsdp_remat",
      4 if s == "dualpipev" else 2,
      s,
      16,
      2 if s == "interleaved" else 1,
      32,
    )
    for s in ("gpipe", "1f1b", "interleaved", "dualpipe", "dualpipev")
  },
}


def preset_config(name: str):
  from configs import decoder

  spec, top, model, moe, mesh, _ = PRESETS[name]
  config = decoder.get_config(spec)
  config.update(top)
  config.model.update(model)
  config.moe.update(moe)
  config.mesh.update(mesh)
  config.data.shards = config.mesh.nodes * config.mesh.gpus_per_node
  return config


def compile_and_scale(config, mesh, model_cfg, target: tuple, whole: bool, explain: bool) -> tuple[list, dict]:
  """(compiled, scaled): the train step compiled whole or as layer variants (`memory_compile.compiled_variants`),
  and its argument, temp, output and alias bytes scaled to the `target` layer counts: {kind: (bytes, coefficients)}."""
  from moejax.models.decoder_config import DecoderConfig

  points = [target] if whole else memory_compile.variants(model_cfg)
  compiled = memory_compile.compiled_variants(
    config, mesh, isinstance(model_cfg, DecoderConfig), points, whole, explain
  )
  scaled = {
    k: memory_compile.scale(points, [c[k] for c in compiled], target) for k in ("argument", "temp", "output", "alias")
  }
  return compiled, scaled


def compiled_bytes(state: tuple, exchange: dict | None, scaled: dict, full, devices: int) -> dict:
  """Per-device bytes by category from the compiled step: the state's (params, optimizer, other state,
  gradients), the exchange buffers, the activations (temp less gradients and buffers), the batch, the output not
  aliased to an input, and their total."""
  params, optimizer, other_state, gradients = state
  rows = full.batch_size // full.micro_batches
  temp = scaled["temp"][0]
  exch = exchange["bytes"] if exchange else 0.0
  out = {
    "parameters": params,
    "optimizer": optimizer,
    "gradients": gradients,
    "exchange_buffers": exch,
    "activations": temp - gradients - exch,
    "other_state": other_state,
    "batch": full.micro_batches * rows * full.seq_len * 4 / devices,
    "unaliased_output": max(0.0, scaled["output"][0] - scaled["alias"][0]),
  }
  out["total"] = params + optimizer + out["other_state"] + out["batch"] + temp + out["unaliased_output"]
  return out


def plan(config, device_gb: float = 80.0, whole: bool = False, explain: bool = False) -> dict:
  """One row of the planner (devices already simulated): the config's per-device bytes by category, compiled and
  analytic, and the verdicts against `device_gb`."""
  from moejax.runtime import mesh as mesh_lib
  from moejax.train import trainer as train

  nodes, gpus = config.mesh.nodes, config.mesh.gpus_per_node
  mesh = mesh_lib.make_mesh(nodes, gpus)
  config, configured, (full, model_cfg, moe_cfg) = memory_compile.checked_on(config, mesh)
  trainer = train.Trainer(full, model_cfg, moe_cfg, mesh, memory_compile.token_ids(model_cfg.vocab_size))
  state = memory_compile.state_bytes(trainer.abstract_state)
  rows = full.batch_size // full.micro_batches
  exchange = memory_lib.exchange_bytes(moe_cfg, mesh, rows * full.seq_len) if model_cfg.num_moe_layers else None
  target = memory_lib.layer_counts(model_cfg)
  # Scanned layers compile in the time of one layer variant whatever the depth, and a variant's segments of one or
  # two repeats do not compile as the loop of many does (docs/memory.md): a scanned model compiles whole.
  whole = whole or model_cfg.scan_layers
  compiled, scaled = compile_and_scale(config, mesh, model_cfg, target, whole, explain)
  out = compiled_bytes(state, exchange, scaled, full, nodes * gpus)
  analytic = memory_rows.analytic(full, model_cfg, moe_cfg, exchange)
  verdict = lambda total: "fits" if total <= device_gb * GB else "does not fit"
  return {
    "model": getattr(model_cfg, "family", getattr(model_cfg, "kind", "?")),
    "mesh": [nodes, gpus],
    "layers": {"dense": target[0], "moe": target[1], "mtp": getattr(model_cfg, "num_mtp_layers", 0)},
    **memory_rows.setting(full, model_cfg, moe_cfg, configured),
    "buffer_factor": moe_cfg.buffer_factor,
    "expert_data_parallel": moe_cfg.expert_data_parallel,
    "schedule": compiled[0]["schedule"],
    "method": "whole model compiled" if whole else "layer variants scaled",
    "variants": compiled,
    "scaling": {k: {"value": val, "base_per_dense_per_moe": coef} for k, (val, coef) in scaled.items()},
    "compiled": out,
    "analytic": analytic,
    "exchange": exchange,
    "device_gb": device_gb,
    "verdict": verdict(out["total"]),
    "analytic_verdict": verdict(analytic["total"]),
    "argument_check": {
      "scaled": scaled["argument"][0],
      "exact_state_and_batch": out["parameters"] + out["optimizer"] + out["other_state"] + out["batch"],
    },
  }


def pipelined_preset(name: str):
  """(training config, (schedule, stages, virtual_stages)) of a PIPELINED row."""
  base, nodes, schedule, stages, virtual, micro = PIPELINED[name]
  config = preset_config(base)
  gpus = config.mesh.gpus_per_node
  config.update(micro_batches=micro, batch_size=micro * nodes * gpus)
  config.mesh.nodes = config.moe.num_nodes = nodes
  config.data.shards = nodes * gpus
  return config, (schedule, stages, virtual)


def configs_to_plan(config) -> dict:
  """name -> (training config, None or its pipeline (schedule, stages, virtual_stages)): the rows config.presets picks
  ('all': PRESETS' and PIPELINED's, 'pipelined': PIPELINED's, or names of either), or the one training config as
  'config', pipelined by planner.schedule; errors name the field."""
  from moejax.pipeline import schedules
  from moejax.train import config as config_lib
  from moejax.validation import require

  if "presets" not in config:
    p = config.planner
    schedule = schedules.SCHEDULES.get(p.schedule)
    require(
      schedule is not None and (schedule.plain or schedule.pipelined),
      "planner.schedule",
      p.schedule,
      f"'none' or one of {sorted(schedules.PIPELINED)}",
    )
    pipeline = None if schedule.plain else (p.schedule, p.stages, p.virtual_stages)
    return {"config": (config_lib.training_config(config), pipeline)}
  keyword = {("all",): [*PRESETS, *PIPELINED], ("pipelined",): list(PIPELINED)}
  names = keyword.get(tuple(config.presets), list(config.presets))
  unknown = [n for n in names if n not in PRESETS and n not in PIPELINED]
  require(
    names and not unknown,
    "presets",
    config.presets,
    f"'all', 'pipelined' or some of {sorted(PRESETS)} and {sorted(PIPELINED)}",
  )
  return {n: (preset_config(n), None) if n in PRESETS else pipelined_preset(n) for n in names}


def main(argv):
  del argv
  from moejax.runtime import mesh as mesh_lib
  from moejax.validation import ConfigError

  config, workdir = _CONFIG.value, _WORKDIR.value
  planner = config.planner
  configs = configs_to_plan(config)
  mesh_lib.simulate_cpu_devices(max(c.mesh.nodes * c.mesh.gpus_per_node for c, _ in configs.values()))
  start, rows = time.perf_counter(), {}
  try:
    for name, (train_config, pipeline) in configs.items():
      if pipeline is None:
        explain = planner.explain or (name in PRESETS and PRESETS[name][5])
        rows[name] = plan(train_config, planner.device_gb, planner.whole, explain)
      else:
        rows[name] = memory_rows.plan_pipelined(train_config, *pipeline, planner.device_gb)
      print(
        (memory_report.format_row if pipeline is None else memory_report.format_pipelined)(name, rows[name]), flush=True
      )
  except (ConfigError, mesh_lib.MeshError) as e:
    sys.exit(f"error: {e}")
  print(memory_report.summary(rows))
  print(f"planned {len(rows)} row(s) in {time.perf_counter() - start:.0f} s")
  if workdir:
    cli.write_json(workdir, "memory.json", {"rows": rows, "run_s": time.perf_counter() - start})


if __name__ == "__main__":
  _CONFIG = cli.define_config(_DEFAULT_CONFIG, "Planner config file (configs/memory.py).")
  _WORKDIR = cli.define_workdir("Directory for memory.json (optional: without it, the tables only).", required=False)
  cli.run(main)
